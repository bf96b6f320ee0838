"""``--weights gguf``: a GGUF's blocks held as stored (:class:`BlockLinear`) and multiplied natively.

Oracles: transformers' own GGUF loader (``gguf.quants.dequantize``, its processor undoing llama.cpp's q/k
row permutation) for the weights and the float model's logits; the model's own forward for the decode
step. A tiny Llama GGUF mixing the block types a ``Q4_K_M`` file holds (Q4_K q/k, Q6_K v and down,
Q4_0 attention output, Q5_0 gate/up and a Q5_0 embedding its tied head reads as blocks; K-quants as
random valid blocks) runs everything quickly.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_int4 import PROJECTIONS, _teacher_forced
from test_models import write_tiny_gguf
from test_quant import gguf_blocks

from selfextend.generation.decode import DecodeStep
from selfextend.generation.generator import Generator
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model
from selfextend.models.blocks import (
    BF16_MIN_ROWS,
    INTERLEAVED,
    BlockEmbedding,
    BlockLinear,
    block_mm,
    reference_product,
    set_chunk_engine,
)
from selfextend.models.quantize import weight_format
from selfextend.native.quant import quant_kernels

Q4_K, Q6_K, Q5_0, Q4_0 = 12, 14, 6, 2
STORED = {"q_proj": Q4_K, "k_proj": Q4_K, "v_proj": Q6_K, "o_proj": Q4_0}
STORED |= {"gate_proj": Q5_0, "up_proj": Q5_0, "down_proj": Q6_K}


def _random(kind: int):
    return lambda rows, columns: gguf_blocks(kind, rows, columns, seed=rows + columns, scales=(2e-5, 1e-4))


@pytest.fixture(scope="module")
def tiny_mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    blocks = {"Q4_K attn_q": _random(Q4_K), "Q4_K attn_k": _random(Q4_K), "Q6_K attn_v": _random(Q6_K)}
    blocks |= {"Q6_K ffn_down": _random(Q6_K), "Q4_0 attn_output": _random(Q4_0)}
    path = tmp_path_factory.mktemp("mixed") / "tiny-mixed.gguf"
    return write_tiny_gguf(path, hidden=256, heads=4, kv_heads=2, quant="Q5_0", blocks=blocks)


@pytest.fixture(scope="module")
def pair(tiny_mixed: Path):
    """The tiny GGUF as transformers loads it (float32, its own dequantisation) and with gguf weights."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        str(tiny_mixed.parent), gguf_file=tiny_mixed.name, dtype=torch.float32
    )
    model, _ = load_model(str(tiny_mixed), weights="gguf")
    return reference.eval(), model


def test_layers_hold_the_stored_blocks(pair, tiny_mixed: Path) -> None:
    """Every projection keeps its stored type (in the kernels' 8-row interleaved form where they hold it so
    here: Q4_0 always, the K-quants where their stored rows are not faster), and its blocks
    dequantise to transformers' weight (q and k rows in the model's order); the embedding table too, its
    bytes shared with the tied head; the cached run form reads back the same layers, still sharing."""
    reference, model = pair
    for ref_layer, layer in zip(reference.model.layers, model.model.layers, strict=True):
        for name in PROJECTIONS:
            part = layer.self_attn if hasattr(layer.self_attn, name) else layer.mlp
            ref_part = ref_layer.self_attn if hasattr(ref_layer.self_attn, name) else ref_layer.mlp
            module = getattr(part, name)
            stored = STORED[name]
            kernels = quant_kernels()
            want = INTERLEAVED[stored] if kernels is not None and kernels.interleaves(stored) else stored
            assert isinstance(module, BlockLinear) and module.kind == want, name
            torch.testing.assert_close(module.dequantized(), getattr(ref_part, name).weight, atol=0, rtol=0)
    # the tied head reads the embedding's own blocks (Q5_0 here), which dequantise to transformers' head;
    # the table holds the same bytes (one storage) and looks up transformers' rows bit for bit
    table, vocab = model.model.embed_tokens, reference.model.embed_tokens.weight.shape[0]
    assert weight_format(model) == "gguf" and isinstance(model.lm_head, BlockLinear)
    assert isinstance(table, BlockEmbedding) and model.lm_head.kind == table.kind == Q5_0
    assert table.blocks.untyped_storage().data_ptr() == model.lm_head.blocks.untyped_storage().data_ptr()
    torch.testing.assert_close(model.lm_head.dequantized(), reference.lm_head.weight, atol=0, rtol=0)
    ids = torch.tensor([[5, 0, vocab - 1], [7, 7, 3]])
    assert torch.equal(table(ids), reference.model.embed_tokens(ids))
    assert torch.equal(table.lookup(torch.arange(vocab)), reference.model.embed_tokens.weight)
    with pytest.raises(IndexError, match="token ids"):
        table(torch.tensor([vocab]))
    again, _ = load_model(str(tiny_mixed), weights="gguf")
    assert (
        again.lm_head.blocks.untyped_storage().data_ptr()
        == again.model.embed_tokens.blocks.untyped_storage().data_ptr()
    )
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and any(k.endswith(".blocks") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [getattr(m, "kind", None) for m in model.modules()] == [
        getattr(m, "kind", None) for m in again.modules()
    ]


def test_logits_close_to_float(pair) -> None:
    """The activations are rounded to int8 per block in each product: logits are the float model's to that
    rounding carried through the layers (2% of the largest), and prefill chunks do not change a row."""
    reference, model = pair
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
        head = model(ids[:, :25]).logits
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.999
    # causal: a shorter prompt gives the same rows (to float32 rounding: the forward's float parts are
    # not bit-for-bit across lengths; the block products' rows are, test_quant checks that)
    torch.testing.assert_close(head, got[:, :25], rtol=0, atol=1e-4)


@pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernel")
def test_logits_close_to_float_through_the_bf16_engine(pair) -> None:
    """A prompt of BF16_MIN_ROWS tokens or more read by the bf16 chunk engine (weight tiles dequantized to
    bfloat16, oneDNN's product): the float model's logits to bfloat16's rounding carried through the
    layers, as close as the int8 engine's."""
    reference, model = pair
    ids = torch.randint(3, 250, (1, BF16_MIN_ROWS + 3), generator=torch.Generator().manual_seed(1))
    before = {m.chunk_engine for m in model.modules() if isinstance(m, BlockLinear)}
    try:
        with torch.no_grad():
            want = reference(ids).logits
            set_chunk_engine(model, "bf16")
            got = model(ids).logits
            set_chunk_engine(model, "int8")
            by_int8 = model(ids).logits
    finally:
        (engine,) = before
        set_chunk_engine(model, engine)
    assert not torch.equal(got, by_int8)  # the two engines really ran
    for logits in (got, by_int8):
        assert (logits - want).abs().max() < 0.02 * want.abs().max()
        assert torch.corrcoef(torch.stack([logits.flatten(), want.flatten()]))[0, 1] > 0.999


def test_reference_product_is_the_kernels_math() -> None:
    """Without the native kernel a layer multiplies by gguf's dequantisation in float32."""
    blocks = torch.from_numpy(gguf_blocks(Q4_K, 9, 512))
    x = torch.randn(3, 512)
    w = BlockLinear(blocks, Q4_K, 512).dequantized()
    torch.testing.assert_close(reference_product(x, blocks, Q4_K), x @ w.T)
    torch.testing.assert_close(
        block_mm(x, blocks, Q4_K), x @ w.T, rtol=0, atol=0.02 * float((x @ w.T).abs().max())
    )


@pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernel")
def test_direct_step_tracks_the_forward(pair) -> None:
    """The decode step calls the block products directly (bfloat16 rows in and out, q/k fused, v apart
    for its other type; the output layer float32 out): the model's own forward's logits through context
    shifts to bfloat16 rounding, the same argmax, and the same greedy tokens."""
    _, model = pair
    ids = torch.randint(3, 250, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    step = DecodeStep(model)
    assert [len(parts) for parts in step.qkv[:1] + step.gate_up[:1]] == [2, 1]  # q/k fused; gate/up fused
    want, _ = _teacher_forced(model, ids)
    got, served = _teacher_forced(model, ids, step)
    assert served >= 30
    # logits in bfloat16 are 0.125 apart near 25, so near-ties fell to the lower id: the head is float32 out
    assert not torch.equal(got, got.bfloat16().float())
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95
    tokens = []
    for direct in (True, False):
        gen = Generator(model, ContextShiftCache(model, n_ctx=64, n_keep=2), direct_decode=direct)
        logits, out = gen.feed(ids[:10]), []
        for _ in range(12):
            out.append(int(logits.argmax()))
            logits = gen.write([out[-1]])
        tokens.append(out)
    assert tokens[0] == tokens[1]


@pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernel")
@pytest.mark.parametrize("extend", [False, True])
def test_direct_rows_are_each_alone_bit_for_bit(pair, extend: bool) -> None:
    """The block products are batch-invariant, so sequences stepped together through the direct step's rows
    (different fills, shifting at different times, bf16 cells) get exactly the logits each gets alone."""
    from selfextend.generation.batched import BatchedDecode
    from selfextend.hf.patch import self_extend

    _, model = pair
    ids = [
        torch.randint(3, 250, (80,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)
    ]
    fills = (1, 9, 21)
    runs = []
    with self_extend(model, 2, 6) if extend else contextlib.nullcontext():
        for together in (True, False):
            gens = []
            for seq, n in zip(ids, fills, strict=True):
                gen = Generator(model, ContextShiftCache(model, n_ctx=32, n_keep=2, dtype=torch.bfloat16))
                gen.feed(seq[:n])
                gens.append(gen)
            decode = BatchedDecode(model)
            steps = []
            for t in range(40):
                pairs = [(g, seq[n + t]) for g, seq, n in zip(gens, ids, fills, strict=True)]
                steps.append(torch.stack(decode(pairs) if together else [g.write([tok]) for g, tok in pairs]))
            runs.append((torch.stack(steps), [g.cache.shifts for g in gens]))
    assert runs[0][1] == runs[1][1] and len(set(runs[0][1])) > 1
    assert torch.equal(runs[0][0], runs[1][0])


@pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernel")
@pytest.mark.parametrize(
    "cells,extend", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)]
)
def test_layers_in_one_native_call_are_the_python_loop_bit_for_bit(
    pair, cells: torch.dtype, extend: bool
) -> None:
    """Every layer of a token in one native call (the step's default for block weights) gives the logits
    of the Python loop over the same kernels bit for bit: one sequence and three stepped together
    (different fills, shifting at different times), the mixed block types' runs (q/k fused, v apart), with
    and without Self-Extend (its grouped keys made in Python, scored in the call)."""
    from selfextend.hf.patch import self_extend

    with self_extend(pair[1], 2, 6) if extend else contextlib.nullcontext():
        native_layers_equal_the_loop(pair[1], cells)


@pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernel")
def test_native_self_extend_finds_grouped_keys_without_torch_calls(pair, monkeypatch) -> None:
    """Under Self-Extend the one-call step takes each layer's grouped keys from its cells' buffer at once
    (CellLayer.grouped_now); the torch path that rotates them runs only when the buffer must catch up (once
    per W tokens here, every 64 at W above 64), not per layer and token (2-3% of a 1.5B model's token)."""
    from selfextend.generation import decode
    from selfextend.hf.patch import self_extend

    slow = []
    found = decode.grouped_decode_keys
    monkeypatch.setattr(decode, "grouped_decode_keys", lambda *a, **k: slow.append(1) or found(*a, **k))
    model, window, tokens = pair[1], 16, 60
    ids = torch.randint(3, 250, (20 + tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    with self_extend(model, 2, window):
        gen = Generator(model, ContextShiftCache(model, n_ctx=128, n_keep=2, dtype=torch.bfloat16))
        gen.feed(ids[:20])
        assert gen.step.native_layers is not None
        for t in ids[20:]:
            gen.write([t])
    layers = len(model.model.layers)
    assert 0 < len(slow) <= layers * (tokens // window + 1)


def native_layers_equal_the_loop(model: torch.nn.Module, cells: torch.dtype, vocab: int = 250) -> None:
    """The test above's check on ``model`` (token ids below ``vocab``), for other files' models too."""
    from selfextend.generation.batched import BatchedDecode

    ids = [
        torch.randint(3, vocab, (130,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)
    ]
    fills = (1, 9, 21)
    runs = []
    for in_c in (True, False):
        gens = []
        for seq, n in zip(ids, fills, strict=True):
            gen = Generator(model, ContextShiftCache(model, n_ctx=32, n_keep=2, dtype=cells))
            gen.feed(seq[:n])
            assert gen.step.native_layers is not None
            if not in_c:
                gen.step.native_layers = None
            gens.append(gen)
        decode, steps = BatchedDecode(model), []
        for t in range(40):
            pairs = [(g, seq[n + t]) for g, seq, n in zip(gens, ids, fills, strict=True)]
            together = decode(pairs)
            alone = gens[0].write([ids[0][fills[0] + 40 + t]])  # the first one on alone after that
            steps.append(torch.cat([torch.stack(together), alone[None]]))
        runs.append((torch.stack(steps), [g.cache.shifts for g in gens]))
    assert runs[0][1] == runs[1][1] and len(set(runs[0][1])) > 1
    assert torch.equal(runs[0][0], runs[1][0])


def test_a_model_loaded_alone_multiplies_natively(tiny_mixed: Path, tmp_path: Path) -> None:
    """A library user who loads a model and never imports the generation package (``ppl`` did not) gets the
    native block product, not the float reference (which made ``ppl --weights gguf`` the float model's)."""
    code = f"""
import sys, torch
from selfextend.models import load_model
from selfextend.models.blocks import reference_product
from selfextend.native.quant import quant_kernels
model, _ = load_model({str(tiny_mixed)!r}, weights="gguf")
layer = model.model.layers[0].mlp.gate_proj
x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    got = layer(x)
assert "selfextend.generation" not in sys.modules, "the generation package was imported"
assert torch.equal(got, quant_kernels()(x, layer.blocks, layer.kind))
assert not torch.equal(got, reference_product(x, layer.blocks, layer.kind))
"""
    env = {**os.environ, "SELFEXTEND_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
