"""Self-Extend patch on tiny models: exactness against the plain model and the reference math."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, TRAINED, make_model
from transformers import DynamicCache

import selfextend
from selfextend.core.attention import self_extend_attention, self_extend_attention_reference
from selfextend.core.rope import rotate
from selfextend.core.validate import ValidationError
from selfextend.hf.facts import ModelError, cache_kwargs
from selfextend.hf.patch import REFERENCE_IMPLEMENTATION

TOL = 1e-4


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def test_group_size_one_equals_plain(family):
    model = make_model(family)
    ids = torch.randint(3, 97, (1, 150))
    plain = logits(model, ids)
    with selfextend.self_extend(model, group_size=1, window=8):
        assert (logits(model, ids) - plain).abs().max() < TOL


def test_window_covering_sequence_equals_plain(family):
    model = make_model(family)
    ids = torch.randint(3, 97, (2, 50))
    plain = logits(model, ids)
    with selfextend.self_extend(model, group_size=4, window=TRAINED - 1):
        assert (logits(model, ids) - plain).abs().max() < TOL


@pytest.mark.parametrize(
    "family, rope",
    [(f, "default") for f in sorted(FAMILIES)] + [("llama", r) for r in ("linear", "llama3", "yarn")],
)
def test_model_efficient_equals_reference(family, rope):
    model = make_model(family, rope=rope)
    ids = torch.randint(3, 97, (1, 300))
    selfextend.apply_self_extend(model, group_size=3, window=7)
    efficient = logits(model, ids)
    selfextend.apply_self_extend(model, group_size=3, window=7, implementation=REFERENCE_IMPLEMENTATION)
    reference = logits(model, ids)
    assert (efficient - reference).abs().max() < TOL
    selfextend.remove_self_extend(model)
    assert (efficient - logits(model, ids)).abs().max() > 1e-3, (
        "300 tokens at G=3, W=7 must differ from plain"
    )


GRID = [
    # (G, W, Lk, Lq): W % G != 0, lengths not multiples of the block size, decode and chunk shapes
    (2, 4, 37, 37),
    (3, 7, 300, 300),
    (4, 10, 513, 513),
    (5, 13, 1000, 1),
    (8, 100, 1999, 1999),
    (6, 1024, 3001, 3001),
    (4, 64, 2500, 333),
    (3, 500, 2047, 1),
    (7, 33, 257, 200),
]


@pytest.mark.parametrize("group_size,window,lk,lq", GRID)
def test_kernel_equals_reference(group_size, window, lk, lq):
    torch.manual_seed(group_size * window + lk)
    b, h, hkv, d = 1, 4, 2, 32
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    q, k, v = torch.randn(b, h, lq, d), torch.randn(b, hkv, lk, d), torch.randn(b, hkv, lk, d)
    start = 5  # positions need not start at 0
    q_pos = torch.arange(start + lk - lq, start + lk)[None]
    k_pos = torch.arange(start, start + lk)[None]
    reference = self_extend_attention_reference(q, k, v, q_pos, k_pos, group_size, window, inv_freq)
    efficient = self_extend_attention(
        rotate(q, q_pos, inv_freq), rotate(k, k_pos, inv_freq), v, q_pos, group_size, window, inv_freq
    )
    assert (efficient - reference).abs().max() < TOL


def test_prefill_then_decode_equals_one_prefill(family):
    model = make_model(family)
    n, m = 40, 12
    ids = torch.randint(3, 97, (1, n + m))
    selfextend.apply_self_extend(model, group_size=3, window=7)
    full = logits(model, ids)
    cache = DynamicCache(config=model.config)
    steps = [logits(model, ids[:, :n], **cache_kwargs(model, cache), use_cache=True)[:, -1]]
    for t in range(n, n + m - 1):
        steps.append(logits(model, ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True)[:, -1])
    decoded = torch.stack(steps, dim=1)
    assert (decoded - full[:, n - 1 : n + m - 1]).abs().max() < TOL


def test_chunked_prefill_equals_one_prefill():
    model = make_model("llama")
    ids = torch.randint(3, 97, (1, 150))
    selfextend.apply_self_extend(model, group_size=4, window=9)
    full = logits(model, ids)
    cache = DynamicCache(config=model.config)
    chunks = [
        logits(model, ids[:, a : a + 37], **cache_kwargs(model, cache), use_cache=True)
        for a in range(0, 150, 37)
    ]
    assert (torch.cat(chunks, dim=1) - full).abs().max() < TOL


def test_static_cache_equals_the_dynamic_one(family):
    """transformers' ``StaticCache`` hands the attention every slot of its length (those past the queries
    not written yet): read as keys ending at the last query, logits were off by 0.33 on this model (4.6 to
    20.8 on SmolLM2 through ``generate(cache_implementation="static")``). Prefill and decode steps past the
    window equal a dynamic cache's, the reference attention's too."""
    from transformers import StaticCache

    model = make_model(family)
    ids = torch.randint(3, 97, (1, 52))
    for implementation in (None, REFERENCE_IMPLEMENTATION):
        kwargs = {} if implementation is None else {"implementation": implementation}
        selfextend.apply_self_extend(model, group_size=3, window=7, **kwargs)
        runs = []
        for cache in (DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=80)):
            steps = [logits(model, ids[:, :40], **cache_kwargs(model, cache), use_cache=True)]
            for t in range(40, 52):
                steps.append(logits(model, ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True))
            runs.append(torch.cat(steps, dim=1))
        assert (runs[0] - runs[1]).abs().max() < TOL, implementation
        selfextend.remove_self_extend(model)


def test_left_padded_rows_without_position_ids_equal_rows_alone():
    """A plain forward of a left-padded batch without ``position_ids`` (transformers then counts the
    padding in the positions; RoPE alone does not care, grouped positions do): a padded row's logits were
    0.18 from the row alone; its positions are now counted from its first token."""
    model = make_model("llama")
    rows = [torch.randint(3, 97, (n,)) for n in (90, 61)]
    ids, mask = _left_pad(rows)
    with selfextend.self_extend(model, group_size=4, window=16):
        batch = logits(model, ids, attention_mask=mask)
        for i, row in enumerate(rows):
            assert (batch[i, ids.shape[1] - len(row) :] - logits(model, row[None])[0]).abs().max() < TOL


def test_right_padded_rows_equal_rows_alone_and_gaps_are_refused():
    """Right padding (a batched perplexity's) raised NotImplementedError: no token sees the slots after it,
    so each row's tokens are as alone. Padding between tokens is a ValidationError (a ValueError, as the
    docs say every library error is), as is a 4D mask."""
    model = make_model("llama")
    rows = [torch.randint(3, 97, (n,)) for n in (90, 61)]
    ids, mask = torch.zeros(2, 90, dtype=torch.long), torch.zeros(2, 90, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    with selfextend.self_extend(model, group_size=4, window=16):
        batch = logits(model, ids, attention_mask=mask)
        for i, row in enumerate(rows):
            assert (batch[i, : len(row)] - logits(model, row[None])[0]).abs().max() < TOL
        gap = torch.ones(2, 90, dtype=torch.long)
        gap[1, 40:50] = 0
        with pytest.raises(ValidationError, match="not between them"):
            logits(model, ids, attention_mask=gap)


def _left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask


def test_left_padded_batch_equals_rows_alone(family):
    model = make_model(family)
    rows = [torch.randint(3, 97, (n,)) for n in (90, 61, 75)]
    ids, mask = _left_pad(rows)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    selfextend.apply_self_extend(model, group_size=3, window=10)
    cache = DynamicCache(config=model.config)
    batch = logits(
        model, ids, attention_mask=mask, position_ids=pos, **cache_kwargs(model, cache), use_cache=True
    )
    nxt = torch.randint(3, 97, (3, 1))
    mask2 = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    step = logits(
        model,
        nxt,
        attention_mask=mask2,
        position_ids=pos[:, -1:] + 1,
        **cache_kwargs(model, cache),
        use_cache=True,
    )
    for i, r in enumerate(rows):
        alone = logits(model, torch.cat([r, nxt[i]])[None])
        assert (batch[i, -len(r) :] - alone[0, :-1]).abs().max() < TOL
        assert (step[i, -1] - alone[0, -1]).abs().max() < TOL


def test_remove_restores_bit_identical(family):
    model = make_model(family)
    ids = torch.randint(3, 97, (1, 120))
    before = logits(model, ids)
    selfextend.apply_self_extend(model, group_size=4, window=8)
    assert not torch.equal(logits(model, ids), before)
    selfextend.remove_self_extend(model)
    assert torch.equal(logits(model, ids), before)
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, "self_extend") for m in model.modules())


@pytest.mark.parametrize(
    "group_size,window,message",
    [(0, 8, "group size"), (2, 0, "window"), (2, TRAINED, "trained window"), (2.5, 8, "group size")],
)
def test_bad_parameters_refused(group_size, window, message):
    model = make_model("llama")
    with pytest.raises(ValueError, match=message):
        selfextend.apply_self_extend(model, group_size, window)
    assert model.config._attn_implementation == "sdpa"


def test_sliding_window_model_refused():
    from conftest import COMMON
    from transformers import MistralConfig, MistralForCausalLM

    model = MistralForCausalLM(MistralConfig(**{**COMMON, "sliding_window": 32}))
    with pytest.raises(ValueError, match="sliding-window"):
        selfextend.apply_self_extend(model, 2, 8)


@pytest.mark.parametrize("implementation", ["selfextend", REFERENCE_IMPLEMENTATION])
def test_what_the_attention_does_not_do_is_said(implementation):
    """No attention weights (output_attentions) and no dropout in training: each said, as transformers'
    sdpa says the first; the output is the same."""
    model = make_model()
    selfextend.apply_self_extend(model, 2, 8, implementation=implementation)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        plain = model(ids).logits
        with pytest.warns(UserWarning, match="returns no attention weights"):
            assert torch.equal(model(ids, output_attentions=True).logits, plain)
    if implementation == "selfextend":
        model.config.attention_dropout = 0.1
        for m in model.modules():
            if hasattr(m, "attention_dropout"):
                m.attention_dropout = 0.1
        with pytest.warns(UserWarning, match="applies no dropout"):
            model.train()(ids)


def test_max_usable_length():
    model = make_model("llama")
    assert selfextend.max_usable_length(model, 4, 16) == (TRAINED - 16) * 4 + 16
    assert selfextend.max_length(8192, 4, 1024) == 29696


@pytest.mark.parametrize(
    "args", [(8192, 0, 1024), (8192, -1, 1024), (8192, 4, 9000), (0, 4, 1024), (8192, 4.0, 1024),
             (8192, float("nan"), 1024), (8192, True, 1024), (None, 4, 1024), ("8192", 4, 1024)]
)  # fmt: skip
def test_max_length_refuses_sizes_that_cannot_work(args):
    """It answered 1024, -6144, 5768, nan... for these: the public formula checks what it is given."""
    with pytest.raises(ValidationError):
        selfextend.max_length(*args)


def test_non_rope_models_refused_as_models():
    """Everywhere as a ModelError that says why: the cache said a ValueError about ``inv_freq``, and
    ``max_usable_length`` called a BLOOM model (no ``max_position_embeddings``) "not a model"."""
    from transformers import BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel

    from selfextend.kv.cache import ContextShiftCache

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=10, bos_token_id=0, eos_token_id=0)
    bloom = BloomForCausalLM(BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=10))
    with pytest.raises(ModelError, match="no rotary position embeddings"):
        selfextend.max_usable_length(config, 4, 32)  # answered 416
    for model in (GPT2LMHeadModel(config), bloom):
        with pytest.raises(ModelError, match="no rotary position embeddings"):
            selfextend.apply_self_extend(model, 4, 32)
        with pytest.raises(ModelError, match="no rotary position embeddings"):
            ContextShiftCache(model, 64)
        with pytest.raises(ModelError, match="no rotary position embeddings"):
            selfextend.max_usable_length(model, 4, 32)


def test_self_extend_blocks_nest():
    """A block inside another (or inside ``apply_self_extend``) gives back the settings it found: it used
    to leave the plain model, silently, for the rest of the outer block."""
    model = make_model("llama")
    ids = torch.randint(3, 97, (1, 150), generator=torch.Generator().manual_seed(0))

    def logits():
        return model(ids).logits

    plain = logits()
    with selfextend.self_extend(model, 4, 16):
        outer = logits()
        with selfextend.self_extend(model, 2, 8):
            inner = logits()
        assert torch.equal(logits(), outer)
    assert torch.equal(logits(), plain) and not torch.equal(outer, plain) and not torch.equal(inner, outer)
    selfextend.apply_self_extend(model, 4, 16)
    with selfextend.self_extend(model, 2, 8):
        pass
    assert torch.equal(logits(), outer)
    selfextend.remove_self_extend(model)
    assert torch.equal(logits(), plain) and model.config._attn_implementation == "sdpa"


def test_portable_kernel_equals_cpu_flash_kernel(monkeypatch):
    """The matmul fallback used off-CPU computes the same attention and log-sum-exp as the fused kernel."""
    import selfextend.core.attend as attend
    import selfextend.core.attention as attention

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 300, 16), torch.randn(1, 4, 300, 16), torch.randn(1, 4, 300, 16)
    mask = torch.zeros(300, 300).masked_fill_(torch.rand(300, 300) < 0.3, float("-inf")).fill_diagonal_(0.0)
    for kwargs in ({"is_causal": True}, {"mask": mask}, {}):
        fused = attend.attend(q, k, v, 0.25, **kwargs)
        portable = attend.attend_math(q, k, v, 0.25, chunk=64, **kwargs)
        assert (fused[0] - portable[0]).abs().max() < TOL and (fused[1] - portable[1]).abs().max() < TOL
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    pos = torch.arange(300)[None]
    reference = self_extend_attention_reference(q, k[:, :2], v[:, :2], pos, pos, 3, 20, inv_freq)
    monkeypatch.setattr(attention, "attend", attend.attend_math)
    portable = self_extend_attention(
        rotate(q, pos, inv_freq), rotate(k[:, :2], pos, inv_freq), v[:, :2], pos, 3, 20, inv_freq
    )
    assert (portable - reference).abs().max() < TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (passed on an H200, 2026-11-30)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_fused_kernels_equal_portable(dtype):
    """cuDNN / flash / memory-efficient attention with log-sum-exp against the portable kernel, on a GPU,
    two query heads to a KV head (cuDNN reads them in place)."""
    import selfextend.core.attend as attend

    torch.manual_seed(0)
    q = torch.randn(1, 4, 300, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 2, 300, 64, device="cuda", dtype=dtype) for _ in range(2))
    mask = torch.zeros(300, 300, device="cuda", dtype=dtype)
    mask.masked_fill_(torch.rand(300, 300, device="cuda") < 0.3, float("-inf")).fill_diagonal_(0.0)
    tol = TOL if dtype == torch.float32 else 2e-2
    for kwargs in ({"is_causal": True}, {"mask": mask}, {}):
        fused = attend.attend_cuda(q, k, v, 0.125, **kwargs)
        portable = attend.attend_math(q, k, v, 0.125, chunk=64, **kwargs)
        assert (fused[0].float() - portable[0].float()).abs().max() < tol
        assert (fused[1] - portable[1]).abs().max() < tol


@pytest.mark.real
def test_real_model_efficient_equals_reference_and_plain_at_g1():
    from selfextend.evaluation.corpus import default_books
    from selfextend.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    # 320 tokens: keys grouped past the 64-token window, the reference's L x L scores still small
    ids = tokenizer(default_books()["sherlock-holmes"][:6000], return_tensors="pt").input_ids[:, :320]
    plain = logits(model, ids)
    with selfextend.self_extend(model, group_size=1, window=64):
        assert (logits(model, ids) - plain).abs().max() < 1e-3
    selfextend.apply_self_extend(model, group_size=4, window=64)
    efficient = logits(model, ids)
    selfextend.apply_self_extend(model, group_size=4, window=64, implementation=REFERENCE_IMPLEMENTATION)
    reference = logits(model, ids)
    selfextend.remove_self_extend(model)
    assert (efficient - reference).abs().max() < 1e-3
    assert (efficient - plain).abs().max() > 0.1


def test_cuda_fallback_warns_once(monkeypatch):
    """Fused CUDA kernels that refuse the problem: one warning per kind of refusal, then the portable math
    (the GPU path's fallback run on CPU tensors, with the fused call made to fail)."""
    import selfextend.core.attend as attend

    def refuse(*args, **kwargs):
        raise RuntimeError("no kernel for head size 72\ndetails")

    monkeypatch.setattr(attend, "attend_cuda", refuse)
    monkeypatch.setattr(attend, "_FALLBACK_WARNED", set())
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    with pytest.warns(UserWarning, match="no kernel for head size 72") as caught:
        out = attend.fused_or_portable(q, k, v, 0.3, is_causal=True)
        attend.fused_or_portable(q, k, v, 0.3, is_causal=True)
    assert len([w for w in caught if "fused CUDA" in str(w.message)]) == 1
    want = attend.attend_math(q, k, v, 0.3, True, None)
    assert (out[0] - want[0]).abs().max() < TOL and (out[1] - want[1]).abs().max() < TOL


def test_an_input_or_cache_past_the_reach_is_warned_once():
    """A library user reading past (L - W) * G + W got no word (the CLI warned; a forward, a cache did
    not): one warning per apply_self_extend, from whichever meets it first; none within the reach."""
    import warnings

    from selfextend.hf.patch import max_usable_length
    from selfextend.kv.cache import ContextShiftCache

    model = make_model()
    selfextend.apply_self_extend(model, 2, TRAINED // 2)
    reach = max_usable_length(model, 2, TRAINED // 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.zeros(1, reach, dtype=torch.long))
        ContextShiftCache(model, reach)
        assert not caught
        model(torch.zeros(1, reach + 1, dtype=torch.long))
        ContextShiftCache(model, 2 * reach)
        model(torch.zeros(1, reach + 2, dtype=torch.long))
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith(f"an input of {reach + 1:,} tokens is past what Self-Extend")
    selfextend.apply_self_extend(model, 2, TRAINED // 2)  # applied again: said again, here by the cache
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ContextShiftCache(model, 2 * reach)
    assert [str(w.message).split(" is past")[0] for w in caught] == [f"a cache of {2 * reach:,} tokens"]


def test_untagged_positions_are_read_on_the_host_once_per_tensor():
    """transformers hands every layer of a forward the same position ids (views of one tensor): their
    first position is read on the host (a GPU sync) once, not once a layer; an in-place edit or a new
    tensor is read again, and the values are those of a fresh read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from selfextend.core.attention import untagged_cells

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:  # int(), bool() of a tensor
                Reads.count += 1
            return func(*args, **(kwargs or {}))

    k = torch.zeros(1, 2, 6, 4)
    ids = torch.arange(10, 16)[None]
    with Reads():
        firsts = [untagged_cells(k, ids.expand(1, -1)).first for _ in range(4)]
        once = Reads.count
        ids.add_(5)
        edited = untagged_cells(k, ids.expand(1, -1)).first
        chunk = untagged_cells(torch.zeros(1, 2, 8, 4), ids).first  # keys before the queries (a cache)
        gaps = untagged_cells(k, torch.tensor([[0, 1, 3, 4, 5, 6]])).first
    assert firsts == [10] * 4 and once == 2  # (the gap test and the first position: one layer's reads)
    assert (edited, chunk, gaps) == (15, 13, None)
