"""The direct decode step against the model's own forward: same logits, through shifts, every variant."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import pytest
import torch
from conftest import ROPE_TYPES, make_model
from torch import nn

import selfextend
from selfextend.generation.decode import DecodeStep, decode_step_for
from selfextend.generation.generator import Generator
from selfextend.hf.patch import REFERENCE_IMPLEMENTATION
from selfextend.kv.cache import ContextShiftCache
from selfextend.models.quantize import Int8Linear, fuse_int8, quantize_int8

TOL = 1e-4


def decoded_logits(
    model: nn.Module, ids: list[int], direct: bool, n_ctx: int = 40, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Logits of every token after the first 20, fed one by one through a shifting cache (of ``dtype``)."""
    gen = Generator(model, ContextShiftCache(model, n_ctx=n_ctx, n_keep=3, dtype=dtype), direct_decode=direct)
    assert (gen.step is not None) == (direct and decode_step_for(model) is not None)
    gen.feed(ids[:20])
    out = torch.stack([gen.feed([t]) for t in ids[20:]])
    assert gen.cache.shifts >= 1
    return out


@contextlib.contextmanager
def self_extended(models: Sequence[nn.Module], on: bool = True) -> Iterator[None]:
    """``models`` with Self-Extend (G=3, W=12) for the block where ``on``, removed after."""
    if on:
        for m in models:
            selfextend.apply_self_extend(m, group_size=3, window=12)
    try:
        yield
    finally:
        if on:
            for m in models:
                selfextend.remove_self_extend(m)


def decoded_against_original(
    model: nn.Module, original: nn.Module, ids: list[int], self_extend: bool
) -> torch.Tensor:
    """Largest |logit difference| between ``model``'s direct step and ``original``'s forward over the same
    shifting cache, both with Self-Extend (G=3, W=12) where asked."""
    with self_extended((original, model), self_extend):
        got = decoded_logits(model, ids, direct=True)
        want = decoded_logits(original, ids, direct=False)
    return (got - want).abs().max()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("self_extend", [False, True])
def test_direct_decode_equals_model_forward(family, self_extend):
    model = make_model(family)
    if self_extend:
        selfextend.apply_self_extend(model, group_size=3, window=12)
    ids = torch.randint(3, 97, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    want = decoded_logits(model, ids, direct=False)
    got = decoded_logits(model, ids, direct=True)
    assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("rope", sorted(ROPE_TYPES))
def test_direct_decode_follows_every_rope_type(rope):
    model = make_model("llama", rope=rope)
    ids = torch.randint(3, 97, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    assert (decoded_logits(model, ids, True) - decoded_logits(model, ids, False)).abs().max() < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("self_extend", [False, True])
def test_direct_decode_over_a_reduced_cache(dtype, self_extend):
    """A bf16/f16 cache: the direct step (plain attention reads the cells as stored, the query rounded to
    their type) against the model's forward over the same cache (upcast cells), and both against a float32
    cache: within test_compiled's tolerance for the type, the same greedy tokens."""
    from test_compiled import CACHE_TOLERANCE

    model = make_model("llama")
    if self_extend:
        selfextend.apply_self_extend(model, group_size=3, window=12)
    ids = torch.randint(3, 97, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    want = decoded_logits(model, ids, direct=False)
    for direct in (False, True):
        got = decoded_logits(model, ids, direct=direct, dtype=dtype)
        assert (got - want).abs().max() <= CACHE_TOLERANCE[dtype] * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("self_extend", [False, True])
def test_direct_decode_with_int8_weights(self_extend):
    """Fused int8 projections compute the same products as the separate ones: equal up to bf16 rounding."""
    model = make_model("qwen2")  # q, k, v carry biases
    quantize_int8(model)
    if self_extend:
        selfextend.apply_self_extend(model, group_size=3, window=12)
    ids = torch.randint(3, 97, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    want = decoded_logits(model, ids, direct=False)
    got = decoded_logits(model, ids, direct=True)
    assert (got - want).abs().max() < 0.02 * want.abs().max()


@pytest.mark.parametrize("family", ["phi3", "gemma"])
def test_other_architectures_use_the_model_forward(family):
    assert decode_step_for(make_model(family)) is None
    with pytest.raises(ValueError, match="DecodeStep does not support"):
        DecodeStep(make_model(family))


def test_reference_attention_is_not_taken_over():
    model = make_model("llama")
    selfextend.apply_self_extend(model, 3, 12, implementation=REFERENCE_IMPLEMENTATION)
    gen = Generator(model, ContextShiftCache(model, n_ctx=40))
    assert gen.step is not None and not gen.step.supported()


@pytest.mark.parametrize("bias", [(False, False), (True, False), (True, True)])
def test_fused_int8_shares_storage_and_computes_the_parts(bias):
    torch.manual_seed(4)
    parts = [Int8Linear.from_linear(nn.Linear(32, n, bias=b)) for n, b in zip((48, 16), bias, strict=True)]
    x = torch.randn(3, 32)
    before = [p(x) for p in parts]
    fused = fuse_int8(parts)
    out = fused(x)
    assert out.shape == (3, 64)
    torch.testing.assert_close(out, torch.cat(before, dim=-1), rtol=0, atol=0)
    for p, b in zip(parts, before, strict=True):
        torch.testing.assert_close(p(x), b, rtol=0, atol=0)
        assert p.weight_int8.untyped_storage().data_ptr() == fused.weight_int8.untyped_storage().data_ptr()


def test_fusing_needs_one_input_size():
    parts = [Int8Linear.from_linear(nn.Linear(32, 8)), Int8Linear.from_linear(nn.Linear(16, 8))]
    with pytest.raises(ValueError, match="share their input size"):
        fuse_int8(parts)


@pytest.fixture(scope="module")
def default_model():
    """SmolLM2 in float32, loaded once for the module (each test changes a copy)."""
    from selfextend.models import load_model

    return load_model()


@pytest.mark.real
@pytest.mark.parametrize("weights", ["float", "int8"])
def test_direct_decode_on_the_default_model(weights, default_model):
    """SmolLM2 with Self-Extend (the grouped part in use) and a shift: direct decode tracks the forward
    (60 cells: the shift at the 60th token, keys grouped past the 32-token window)."""
    import copy

    from selfextend.evaluation.corpus import default_books

    model, tokenizer = copy.deepcopy(default_model[0]), default_model[1]
    if weights == "int8":
        quantize_int8(model)
    selfextend.apply_self_extend(model, group_size=4, window=32)
    text = next(iter(default_books().values()))
    ids = tokenizer(text[:4000]).input_ids[:80]
    got, want = (decoded_logits(model, ids, direct=d, n_ctx=60) for d in (True, False))
    tolerance = 1e-4 if weights == "float" else 0.05  # int8: bf16 activations, rounded 30 layers deep
    assert (got - want).abs().max() < tolerance * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("self_extend", [False, True])
def test_gemma3_direct_decode_with_int8_weights(dtype, self_extend):
    """Gemma 3 with int8 products: the native norms (1 + weight), the tanh-GELU gate, the q/k norms in the
    rotation and the norms added after attention and MLP against the model's forward, through shifts, over
    float32 or bf16 cells: within bf16 rounding of activations, the same greedy tokens nearly everywhere."""
    from conftest import tiny_gemma3

    model = tiny_gemma3(["sliding_attention", "full_attention", "sliding_attention"], 16, seed=1)
    quantize_int8(model)
    if self_extend:
        selfextend.apply_self_extend(model, group_size=3, window=12)
    ids = torch.randint(3, 97, (70,), generator=torch.Generator().manual_seed(6)).tolist()
    want = decoded_logits(model, ids, direct=False, dtype=dtype)
    got = decoded_logits(model, ids, direct=True, dtype=dtype)
    assert (got - want).abs().max() < 0.03 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def test_head_norms_the_kernel_cannot_apply_keep_attention_in_torch():
    """A q/k norm that is not a known RMSNorm (here a subclass with another name): attention goes through
    torch ops, where the module itself runs, and the step still gives the model's logits."""
    model = make_model("qwen3")
    for layer in model.model.layers:
        norm = layer.self_attn.q_norm
        layer.self_attn.q_norm = type("OtherNorm", (type(norm),), {})(
            norm.weight.shape[0], norm.variance_epsilon
        )
        layer.self_attn.q_norm.load_state_dict(norm.state_dict())
    step = DecodeStep(model)
    assert step.kernel is None
    ids = torch.randint(3, 97, (60,), generator=torch.Generator().manual_seed(7)).tolist()
    assert (decoded_logits(model, ids, True) - decoded_logits(model, ids, False)).abs().max() < TOL


@pytest.mark.parametrize("rope", [*sorted(ROPE_TYPES), "dynamic", "gemma3"])
def test_kept_rope_factors_are_the_rotary_modules_own(rope):
    """The decode step's per-position RoPE factors (kept a block at a time for RoPE types that depend on the
    position alone) are bit for bit what the model's rotary module gives at that position alone, across
    blocks, past the kept bytes and for several rows; a dynamic RoPE type is asked every time, for the rows
    together (as the step asked before it kept any)."""
    from conftest import tiny_gemma3

    from selfextend.generation.rotary import PositionRotations, rope_by_kind, rotations_at
    from selfextend.hf.facts import layer_kinds

    if rope == "gemma3":
        model = tiny_gemma3(["sliding_attention", "full_attention"], sliding_window=8)
    elif rope == "dynamic":
        model = make_model()
        model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
        model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    else:
        model = make_model(rope=rope)
    rotary, kinds = model.model.rotary_emb, layer_kinds(model)
    kept = PositionRotations(rotary, kinds, block=16, max_bytes=48 * 16 * 8 * len(set(kinds)))
    assert kept.static == (rope != "dynamic")
    x = torch.zeros(2, 1, model.config.hidden_size)
    for pos in ([0, 1], [15, 16], [3, 200], [39, 2], [41, 100]):  # 48 positions fit in max_bytes
        found = kept(x, pos)
        together = rotations_at(rotary, kinds, rope_by_kind(rotary), x, torch.tensor(pos))
        for j, p in enumerate(pos):
            # a dynamic type's factors depend on the highest position asked for: the rows' own call
            alone = rotations_at(rotary, kinds, rope_by_kind(rotary), x[:1], torch.tensor([p]))
            row, source = (0, alone) if kept.static else (j, together)
            expected = {k: (r.cos[row], r.sin[row]) for k, r in source.items()}
            assert set(found[j]) == set(expected)
            for kind, (cos, sin) in expected.items():
                assert torch.equal(found[j][kind][0], cos.reshape(-1))
                assert torch.equal(found[j][kind][1], sin.reshape(-1))
    assert len(kept.rows) == (48 if kept.static else 0)
