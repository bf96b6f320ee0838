"""Hybrid-attention models (sliding and full layers mixed): Self-Extend on the full layers only.

Tiny random Gemma 3 (local RoPE base 10k, global 1M, as the real model), Qwen2 with sliding
layers and Gemma 2 without soft-capping, against the full-matrix reference, in prefill and decode,
and the context-shift cache re-rotating each layer with its own frequencies.
"""

from __future__ import annotations

import pytest
import torch
from conftest import COMMON, TRAINED, tiny_gemma3
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import selfextend
from selfextend.core.rope import layer_frequencies
from selfextend.generation.decode import DecodeStep
from selfextend.generation.generator import Generator
from selfextend.hf.facts import cache_kwargs
from selfextend.hf.patch import REFERENCE_IMPLEMENTATION, OwnAttention, SelfExtendParams
from selfextend.kv.cache import ContextShiftCache
from selfextend.native.decode import native_kernels

TOL = 1e-4
SLIDING = 16
KINDS = ["sliding_attention", "full_attention", "sliding_attention"]


def gemma3(layer_types=KINDS, sliding_window=SLIDING, seed=0):
    return tiny_gemma3(layer_types, sliding_window, seed)


def qwen2_hybrid():
    torch.manual_seed(0)
    config = Qwen2Config(
        **{**COMMON, "num_hidden_layers": 3},
        use_sliding_window=True,
        sliding_window=SLIDING,
        max_window_layers=1,
    )
    return Qwen2ForCausalLM(config).eval()


def gemma2(softcap=None):
    torch.manual_seed(0)
    config = Gemma2Config(
        **COMMON,
        head_dim=16,
        sliding_window=SLIDING,
        attn_logit_softcapping=softcap,
        final_logit_softcapping=None,
        query_pre_attn_scalar=16,
    )
    return Gemma2ForCausalLM(config).eval()


HYBRIDS = {"gemma3": gemma3, "qwen2-sliding": qwen2_hybrid, "gemma2": gemma2}


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def test_tiny_models_are_hybrid():
    assert layer_frequencies(gemma3())[0].inv_freq[1] != layer_frequencies(gemma3())[1].inv_freq[1]
    for make in HYBRIDS.values():
        kinds = set(make().config.layer_types)
        assert kinds == {"sliding_attention", "full_attention"}


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_only_full_layers_are_patched(name):
    model = HYBRIDS[name]()
    selfextend.apply_self_extend(model, group_size=3, window=7)
    kinds = model.config.layer_types
    for m in selfextend.hf.patch.attention_modules(model):
        expected = SelfExtendParams if kinds[m.layer_idx] == "full_attention" else OwnAttention
        assert isinstance(m.self_extend, expected)
    full = [
        m for m in selfextend.hf.patch.attention_modules(model) if isinstance(m.self_extend, SelfExtendParams)
    ]
    rotary = model.model.rotary_emb
    own = getattr(rotary, "full_attention_inv_freq", getattr(rotary, "inv_freq", None))
    assert all(torch.equal(m.self_extend.inv_freq, own) for m in full)


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_prefill_efficient_equals_reference_and_differs_from_plain(name):
    model = HYBRIDS[name]()
    ids = torch.randint(3, 97, (1, 300))
    plain = logits(model, ids)
    selfextend.apply_self_extend(model, group_size=3, window=7)
    efficient = logits(model, ids)
    selfextend.apply_self_extend(model, group_size=3, window=7, implementation=REFERENCE_IMPLEMENTATION)
    reference = logits(model, ids)
    assert (efficient - reference).abs().max() < TOL
    assert (efficient - plain).abs().max() > 1e-3, "300 tokens at G=3, W=7 must differ from plain"
    selfextend.remove_self_extend(model)
    assert torch.equal(logits(model, ids), plain)


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_group_size_one_equals_plain(name):
    model = HYBRIDS[name]()
    ids = torch.randint(3, 97, (1, 120))
    plain = logits(model, ids)
    with selfextend.self_extend(model, group_size=1, window=8):
        assert (logits(model, ids) - plain).abs().max() < TOL


@pytest.mark.parametrize("implementation", ["selfextend", REFERENCE_IMPLEMENTATION])
def test_gemma3_decode_equals_prefill(implementation):
    """Decoding through transformers' own hybrid cache (sliding layers keep their window only)."""
    model = gemma3()
    n, m = 60, 10
    ids = torch.randint(3, 97, (1, n + m))
    selfextend.apply_self_extend(model, group_size=3, window=7, implementation=implementation)
    full = logits(model, ids)
    cache = DynamicCache(config=model.config)
    steps = [logits(model, ids[:, :n], **cache_kwargs(model, cache), use_cache=True)[:, -1]]
    for t in range(n, n + m - 1):
        steps.append(logits(model, ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True)[:, -1])
    assert (torch.stack(steps, dim=1) - full[:, n - 1 : n + m - 1]).abs().max() < TOL


@pytest.mark.parametrize("kind", ["sliding_attention", "full_attention"])
def test_shift_rerotates_with_each_layers_own_frequencies(kind):
    """One layer of either kind: after shifts the cache must equal a fresh forward over the kept tokens,
    which only holds if the keys were re-rotated with that layer's base (10k or 1M)."""
    model = gemma3(layer_types=[kind], sliding_window=TRAINED - 1)
    cache = ContextShiftCache(model, n_ctx=40, n_keep=5)
    gen = Generator(model, cache)
    ids = torch.randint(3, 97, (90,)).tolist()
    out = gen.feed(ids[:20])
    for t in ids[20:]:
        out = gen.feed([t])
    assert cache.shifts >= 3
    with torch.no_grad():
        fresh = model(torch.tensor([gen.tokens])).logits[0, -1]
    assert (out - fresh).abs().max() < TOL


def test_gemma3_generation_through_shifts_matches_reference():
    """Self-Extend on the full layers, own attention on the sliding ones, several shifts: the efficient
    kernel and the reference give the same logits at every step."""
    ids = torch.randint(3, 97, (100,)).tolist()
    runs = []
    for implementation in ("selfextend", REFERENCE_IMPLEMENTATION):
        model = gemma3()
        selfextend.apply_self_extend(model, group_size=3, window=7, implementation=implementation)
        gen = Generator(model, ContextShiftCache(model, n_ctx=48, n_keep=4))
        steps = [gen.feed(ids[:30])]
        steps += [gen.feed([t]) for t in ids[30:]]
        assert gen.cache.shifts >= 3
        runs.append(torch.stack(steps))
    assert (runs[0] - runs[1]).abs().max() < TOL


class CountedStep(DecodeStep):
    """A decode step that counts the tokens it serves."""

    calls = 0

    def __call__(self, token: int, cache: ContextShiftCache) -> torch.Tensor:
        self.calls += 1
        return super().__call__(token, cache)


@pytest.mark.parametrize("extend", [False, True])
@pytest.mark.parametrize("sliding", [True, False])
def test_gemma3_single_tokens_go_through_the_decode_step(extend, sliding):
    """A generator writes Gemma 3's single tokens through its DecodeStep (sliding layers read the last run of
    their cells, compacted when the ring wrapped; or, in a full-size cache, the last ``window`` of them), and
    gets the model's forward's logits at every step through shifts, native kernels or torch ops."""
    ids = torch.randint(3, 97, (100,)).tolist()
    model = gemma3()
    if extend:
        selfextend.apply_self_extend(model, group_size=3, window=7)
    runs = []
    for direct, native in ((True, True), (True, False), (False, False)):
        gen = Generator(
            model, ContextShiftCache(model, n_ctx=48, n_keep=4, sliding=sliding), direct_decode=direct
        )
        assert (gen.step is not None) == direct and gen.fast is None
        if direct:
            gen.step = CountedStep(model, native=native)
            assert (gen.step.native is not None) == (native and native_kernels() is not None)
        steps = [gen.feed(ids[:30])] + [gen.feed([t]) for t in ids[30:]]
        assert gen.cache.shifts >= 3
        assert gen.step is None or gen.step.calls == 70
        runs.append(torch.stack(steps))
    for run in runs[:2]:
        assert (run - runs[2]).abs().max() < TOL


def test_all_sliding_refused():
    """(Gemma 2's soft-capping is served: tests/test_gguf_families.py.)"""
    with pytest.raises(ValueError, match="every layer"):
        selfextend.apply_self_extend(gemma3(layer_types=["sliding_attention"] * 2), group_size=3, window=7)


@pytest.mark.parametrize("lk,lq,window", [(700, 700, 512), (700, 1, 512), (900, 300, 100), (40, 40, 64)])
def test_sliding_window_kernel_equals_masked_sdpa(lk, lq, window):
    from selfextend.core.attention import repeat_kv, sliding_window_attention

    torch.manual_seed(lk + lq)
    q, k, v = torch.randn(1, 4, lq, 16), torch.randn(1, 2, lk, 16), torch.randn(1, 2, lk, 16)
    distance = torch.arange(lk - lq, lk)[:, None] - torch.arange(lk)[None]  # (Lq, Lk)
    allowed = (distance >= 0) & (distance < window)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=allowed, scale=0.25
    )
    assert (sliding_window_attention(q, k, v, window, 0.25) - expected).abs().max() < TOL


def test_gemma3_left_padded_batch_equals_rows_alone():
    """With padding the sliding layers take transformers' masked SDPA path; rows must match unpadded."""
    model = gemma3()
    selfextend.apply_self_extend(model, group_size=3, window=7)
    a, b = torch.randint(3, 97, (1, 80)), torch.randint(3, 97, (1, 60))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 20, dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :20] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = logits(model, batch, attention_mask=mask, position_ids=pos)
    assert (out[0, -1] - logits(model, a)[0, -1]).abs().max() < TOL
    assert (out[1, -1] - logits(model, b)[0, -1]).abs().max() < TOL
