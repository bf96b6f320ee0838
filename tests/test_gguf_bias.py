"""Qwen2's q/k/v biases on GGUF block weights in the decode step: served by the direct products (the
bfloat16 product, then ``float32(product) + bias``) and by the one-call native layers, which add them in
the same arithmetic.

Oracles: transformers' own GGUF loader (its float32 dequantisation of the same file) for the logits, to the
activations' int8 rounding; the Python loop over the same kernels for the native layers, bit for bit. The
tiny Qwen2 has random biases large against its products (transformers initialises them to zero), and its
v projection in another block type than q and k (as a Q4_K_M file's), so the fused q/k run and v each
carry theirs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import gguf_write
import pytest
import torch
from conftest import make_model
from test_decode import decoded_logits, self_extended
from test_gguf_blocks import native_layers_equal_the_loop

import selfextend
from selfextend.generation.decode import DecodeStep
from selfextend.generation.products import blocks_bias, direct
from selfextend.models import load_model
from selfextend.models.blocks import BlockLinear
from selfextend.native.decode import native_kernels
from selfextend.native.quant import quant_kernels

pytestmark = pytest.mark.skipif(
    quant_kernels() is None or native_kernels() is None, reason="no C compiler here to build the kernels"
)
VOCAB = 97  # conftest's COMMON
PROJECTIONS = ("q_proj", "k_proj", "v_proj")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    """(transformers' float32 model from the GGUF, ours with gguf weights, the original's q/k/v biases)."""
    from transformers import AutoModelForCausalLM

    original = make_model("qwen2")
    with torch.no_grad():
        for layer in original.model.layers:
            for name in PROJECTIONS:
                getattr(layer.self_attn, name).bias.normal_(0.0, 1.0)
    biases = [
        torch.cat([getattr(m.self_attn, n).bias.detach() for n in PROJECTIONS]) for m in original.model.layers
    ]
    path = tmp_path_factory.mktemp("qwen2-bias") / "qwen2-bias.gguf"
    gguf_write.write(original, original.config, path, file_type="Q8_0", types={"attn_v": "Q4_0"})
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model, _ = load_model(str(path), weights="gguf")
    return reference.eval(), model, biases


def test_biases_held_by_the_block_layers_and_served_natively(models) -> None:
    """Each q/k/v block layer holds the file's float32 bias; the step fuses q and k (one type) and keeps v
    apart, serves them directly with the biases side by side in that order, and runs every layer natively."""
    _, model, biases = models
    step = DecodeStep(model)
    assert step.native_layers is not None
    for layer, parts, want in zip(model.model.layers, step.qkv, biases, strict=True):
        assert all(isinstance(getattr(layer.self_attn, n), BlockLinear) for n in PROJECTIONS)
        assert len(parts) == 2 and parts[0].kind != parts[1].kind and direct(parts)
        assert torch.equal(blocks_bias(parts), want)


@contextlib.contextmanager
def _without_biases(model: torch.nn.Module) -> Iterator[None]:
    """``model``'s q/k/v biases zeroed for the block, then put back."""
    biases = [getattr(m.self_attn, n).bias for m in model.model.layers for n in PROJECTIONS]
    saved = [b.detach().clone() for b in biases]
    with torch.no_grad():
        for b in biases:
            b.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(biases, saved, strict=True):
                b.copy_(value)


@pytest.mark.parametrize("extend", [False, True])
def test_decode_step_tracks_transformers(models, extend: bool) -> None:
    """Token by token through a shifting cache, plain and with Self-Extend: transformers' logits on the
    file's float values to the activations' rounding (the model's own forward is as far: 1.7% of the
    largest logit at most, 0.35% on average), the same argmax almost everywhere; the same file without its
    biases is far off (so they are added, once)."""
    reference, model, _ = models
    ids = torch.randint(3, VOCAB, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    with self_extended((reference, model), extend):
        got = decoded_logits(model, ids, direct=True)
        want = decoded_logits(reference, ids, direct=False)
        with _without_biases(reference):
            unbiased = decoded_logits(reference, ids, direct=False)
    scale = want.abs().max()
    assert (got - want).abs().mean() < 0.01 * scale and (got - want).abs().max() < 0.03 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    assert (got - unbiased).abs().mean() > 0.1 * scale, (got - unbiased).abs().mean() / scale


@pytest.mark.parametrize(
    "cells,extend", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)]
)
def test_native_layers_are_the_python_loop_bit_for_bit(models, cells: torch.dtype, extend: bool) -> None:
    """The one native call adds the q/k/v biases as the Python loop's direct products do: the same logits
    bit for bit, one sequence and three stepped together, plain and with Self-Extend."""
    _, model, _ = models
    if extend:
        selfextend.apply_self_extend(model, group_size=2, window=6)
    try:
        native_layers_equal_the_loop(model, cells, vocab=VOCAB)
    finally:
        if extend:
            selfextend.remove_self_extend(model)
