"""Sliding-window layers in the context-shift cache hold only their window and the kept cells.

Tiny random Gemma 3 (window 8, contexts of 40-64 cells): logits through the bounded cache equal those
through the full-buffer layout (``sliding=False``, every layer ``n_ctx`` cells) at every step, through
prefill chunks smaller and larger than the window, decoding and shifts (llama.cpp's half, and shifts that
drop almost everything so the kept cells come back inside the window), with and without Self-Extend on
the full layers, in a left-padded batch; Qwen2 with sliding layers, Gemma 2 and an all-sliding Mistral
likewise; a one-layer model against a fresh forward; truncation exact
or refused, and recomputed by ``Generator.rewind``; prompt caches and chat sessions.
"""

from __future__ import annotations

import pytest
import torch
from conftest import COMMON, tiny_gemma3
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import selfextend
from selfextend.generation import generator as generate
from selfextend.generation.generator import Generator
from selfextend.hf.facts import cache_kwargs
from selfextend.kv import promptcache
from selfextend.kv.cache import ContextShiftCache, cache_bytes, layer_cells
from selfextend.kv.sliding import SlidingShiftLayer

TOL = 1e-4
WINDOW = 8
KINDS = ["sliding_attention", "full_attention", "sliding_attention"]
CHUNKS = [20, 1, 1, 3, 1, 12, 1, 1, 1, 27, 2, 1, 5, 1, 1, 1, 1, 1, 1, 9]  # below and above the window


def model(kinds=KINDS, self_extend=False):
    m = tiny_gemma3(kinds, WINDOW)
    if self_extend:
        selfextend.apply_self_extend(m, group_size=3, window=5)
    return m


def most(n_past: int, n_keep: int, n_need: int) -> int:
    """A discard policy that leaves 3 cells after the kept ones: they all come back inside the window."""
    return max(n_need, n_past - n_keep - 3)


def held(layer) -> list[tuple[int, int]]:
    """The positions a layer's cells hold, as increasing [lo, hi) ranges."""
    out: list[tuple[int, int]] = []
    for p in sorted(layer.positions[: layer.n_used].tolist()):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def pieces(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, a, i = [], 0, 0
    while a < len(ids):
        out.append(ids[a : a + sizes[i % len(sizes)]])
        a, i = a + sizes[i % len(sizes)], i + 1
    return out


def run(m, cache, ids, sizes=CHUNKS, policy=None) -> tuple[torch.Tensor, Generator]:
    """Last logits after each piece fed through ``cache``."""
    cache.discard_policy = policy
    gen = Generator(m, cache)
    return torch.stack([gen.feed(p) for p in pieces(ids, sizes)]), gen


def test_layout_and_bytes():
    m = model()
    cache = ContextShiftCache(m, n_ctx=64, n_keep=5, dtype=torch.float16)
    assert [type(x).__name__ for x in cache.layers] == [
        "SlidingShiftLayer",
        "ContextShiftLayer",
        "SlidingShiftLayer",
    ]
    assert (
        [x.keys.shape[-2] for x in cache.layers] == [5 + 2 * 7, 64, 5 + 2 * 7] == layer_cells(m.config, 64, 5)
    )
    assert cache.nbytes() == cache_bytes(m.config, 64, 5, bytes_per_value=2)
    full = ContextShiftCache(m, n_ctx=64, n_keep=5, dtype=torch.float16, sliding=False)
    assert [x.keys.shape[-2] for x in full.layers] == [64] * 3
    assert full.nbytes() == cache_bytes(m.config, 64, 5, sliding=False) > cache.nbytes()
    assert cache.is_sliding == [True, False, True]
    # a window whose bounded layout would not be smaller than n_ctx keeps the full one
    assert layer_cells(m.config, 19, 5) == [19, 19, 19] and layer_cells(m.config, 20, 5) == [19, 20, 19]


@pytest.mark.parametrize("n_keep", [0, 5])
@pytest.mark.parametrize("self_extend", [False, True])
@pytest.mark.parametrize("policy", [None, most], ids=["half", "most"])
def test_logits_equal_full_buffer_layout(n_keep, self_extend, policy):
    m = model(self_extend=self_extend)
    ids = torch.randint(3, 97, (300,)).tolist()
    bounded = ContextShiftCache(m, n_ctx=64, n_keep=n_keep)
    ptrs = [(x.keys.data_ptr(), x.values.data_ptr()) for x in bounded.layers]
    got, gen = run(m, bounded, ids, policy=policy)
    want, ref = run(m, ContextShiftCache(m, n_ctx=64, n_keep=n_keep, sliding=False), ids, policy=policy)
    assert bounded.shifts >= 5 and bounded.shifts == ref.cache.shifts and gen.tokens == ref.tokens
    assert (got - want).abs().max() < TOL
    assert [(x.keys.data_ptr(), x.values.data_ptr()) for x in bounded.layers] == ptrs  # allocated once
    sliding = bounded.layers[0]
    assert isinstance(sliding, SlidingShiftLayer) and sliding.n_used <= sliding.capacity


def _other(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "qwen2":  # layer 0 full, 1 and 2 sliding
        config = Qwen2Config(
            **{**COMMON, "num_hidden_layers": 3},
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        )
        return Qwen2ForCausalLM(config).eval()
    if family == "gemma2":  # alternating, no soft-capping
        return Gemma2ForCausalLM(
            Gemma2Config(
                **COMMON,
                head_dim=16,
                sliding_window=WINDOW,
                attn_logit_softcapping=None,
                final_logit_softcapping=None,
                query_pre_attn_scalar=16,
            )
        ).eval()
    return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=WINDOW)).eval()  # every layer slides


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "mistral"])
def test_other_sliding_families_equal_full_buffer_layout(family):
    m = _other(family)
    ids = torch.randint(3, 97, (150,)).tolist()
    bounded = ContextShiftCache(m, n_ctx=48, n_keep=4)
    assert any(isinstance(x, SlidingShiftLayer) for x in bounded.layers)
    got, _ = run(m, bounded, ids)
    want, _ = run(m, ContextShiftCache(m, n_ctx=48, n_keep=4, sliding=False), ids)
    assert bounded.shifts >= 3 and (got - want).abs().max() < TOL


@pytest.mark.parametrize("policy", [None, most], ids=["half", "most"])
def test_one_sliding_layer_equals_fresh_forward(policy):
    """One layer: its cells depend on the token and position only, so after shifts the cache must give what a
    fresh forward over the kept tokens gives (with "most", the kept cells are inside the window again)."""
    m = model(kinds=["sliding_attention"])
    cache = ContextShiftCache(m, n_ctx=40, n_keep=5)
    assert isinstance(cache.layers[0], SlidingShiftLayer)
    cache.discard_policy = policy
    gen = Generator(m, cache)
    ids = torch.randint(3, 97, (120,)).tolist()
    came_back = False
    for piece in pieces(ids, [11, 1, 1, 1, 14, 1, 2, 1, 1]):
        out = gen.feed(piece)
        in_window = cache.n_past - WINDOW < 5 < cache.n_past - 1  # the kept cells are back in the window
        came_back |= in_window and cache.shifts > 0
        with torch.no_grad():
            fresh = m(torch.tensor([gen.tokens])).logits[0, -1]
        assert (out - fresh).abs().max() < TOL
    assert cache.shifts >= 3 and came_back == (policy is most)


@pytest.mark.parametrize("self_extend", [False, True])
def test_left_padded_batch_equals_full_buffer_layout(self_extend):
    """Batch 2, the second row left-padded: the sliding layers take transformers' masked path, whose mask
    is built for keys from the cache's offset on."""
    m = model(self_extend=self_extend)
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (2, 110))
    results = []
    for sliding in (True, False):
        cache = ContextShiftCache(m, n_ctx=48, n_keep=4, batch_size=2, sliding=sliding)
        mask = torch.ones(2, 0, dtype=torch.long)
        steps = []
        for a, b in (
            (0, 20),
            (20, 21),
            (21, 40),
            (40, 41),
            (41, 42),
            (42, 60),
            *((t, t + 1) for t in range(60, 110)),
        ):
            before = cache.n_past
            if cache.make_room(b - a):
                gone = before - cache.n_past
                mask = torch.cat([mask[:, : cache.n_keep], mask[:, cache.n_keep + gone :]], dim=1)
            new = torch.ones(2, b - a, dtype=torch.long)
            if a == 0:
                new[1, :6] = 0  # row 1: 6 padding tokens
            mask = torch.cat([mask, new], dim=1)
            with torch.no_grad():
                out = m(ids[:, a:b], attention_mask=mask, **cache_kwargs(m, cache), use_cache=True).logits
            steps.append(out[:, -1])
        assert cache.shifts >= 3
        results.append(torch.stack(steps))
    assert torch.isfinite(results[0]).all()
    assert (results[0] - results[1]).abs().max() < TOL


def test_truncate_exact_or_refused_and_rewind_recomputes():
    m = model(self_extend=True)
    ids = torch.randint(3, 97, (40,)).tolist()
    gen = Generator(m, ContextShiftCache(m, n_ctx=64, n_keep=4))
    ref = Generator(m, ContextShiftCache(m, n_ctx=64, n_keep=4, sliding=False))
    for g in (gen, ref):
        g.feed(ids[:30])  # one write larger than the window: the sliding layers keep the last 7 cells
    assert held(gen.cache.layers[0]) == [(0, 4), (23, 30)]
    assert gen.cache.can_truncate(4) and not gen.cache.can_truncate(29)
    with pytest.raises(ValueError, match="cannot go back to 29"):
        gen.cache.truncate(29)
    assert gen.cache.n_past == 30  # refused: nothing changed
    gen.rewind(25)  # recomputed from the kept cells on
    ref.rewind(25)  # exact
    assert gen.tokens == ref.tokens == ids[:25] and gen.cache.n_past == 25
    for t in ids[25:31]:
        assert (gen.feed([t]) - ref.feed([t])).abs().max() < TOL
    assert held(gen.cache.layers[0]) == [(0, 4), (18, 31)]  # decoded in place: more than the window held
    assert gen.cache.can_truncate(29)
    gen.cache.truncate(29)
    ref.rewind(29)
    assert held(gen.cache.layers[0]) == [(0, 4), (18, 29)]
    gen.tokens = gen.tokens[:29]
    assert (gen.feed(ids[29:34]) - ref.feed(ids[29:34])).abs().max() < TOL


def test_prompt_cache_round_trip(tmp_path):
    m = model()
    prompt = torch.randint(3, 97, (40,)).tolist()
    gen = Generator(m, ContextShiftCache(m, n_ctx=64, n_keep=4))
    logits = gen.feed(prompt)
    promptcache.save(tmp_path / "p.pt", m, gen.cache, gen.tokens, logits)
    payload = torch.load(tmp_path / "p.pt", weights_only=True)
    # fed as 30 + 10 tokens: the first write keeps 23..29, the second 33..39 in free slots (23..29 stay)
    assert payload["positions"][0].tolist() == [*range(4), *range(23, 30), *range(33, 40)]
    assert payload["positions"][1].tolist() == list(range(40))
    assert payload["keys"][0].shape[-2] == 18 and payload["keys"][1].shape[-2] == 40

    def continued(cache, reused, saved_logits, p):
        g = Generator(m, cache, tokens=list(reused))
        out = saved_logits if saved_logits is not None and len(reused) == len(p) else g.feed(p[len(reused) :])
        return torch.stack([out, g.feed([5]), g.feed([7])])

    expected = continued(ContextShiftCache(m, n_ctx=64, n_keep=4), [], None, prompt)
    cache = ContextShiftCache(m, n_ctx=64, n_keep=4)
    reused, saved = promptcache.load(tmp_path / "p.pt", m, cache, prompt)
    assert reused == prompt and saved is not None
    assert (continued(cache, reused, saved, prompt) - expected).abs().max() < TOL
    # a prompt sharing 22 tokens: the file lacks the sliding window before token 22, only the kept 4 load;
    # one sharing 30 finds the window before token 30 (23..29) and loads them all
    for shared, loads in ((22, 4), (30, 30)):
        other = prompt[:shared] + [9, 9, 9]
        cache = ContextShiftCache(m, n_ctx=64, n_keep=4)
        reused, saved = promptcache.load(tmp_path / "p.pt", m, cache, other)
        assert reused == other[:loads] and saved is None
        fresh = continued(ContextShiftCache(m, n_ctx=64, n_keep=4), [], None, other)
        assert (continued(cache, reused, None, other) - fresh).abs().max() < TOL
    # shorter prompts likewise (36 lacks 30..32, which the second write never stored: 30 load); a longer one
    # reuses all the file has
    assert promptcache.load(tmp_path / "p.pt", m, ContextShiftCache(m, 64, 4), prompt[:20])[0] == prompt[:4]
    assert promptcache.load(tmp_path / "p.pt", m, ContextShiftCache(m, 64, 4), prompt[:36])[0] == prompt[:30]
    longer = prompt + [9, 9]
    cache = ContextShiftCache(m, n_ctx=64, n_keep=4)
    reused, saved = promptcache.load(tmp_path / "p.pt", m, cache, longer)
    assert reused == prompt and saved is None
    fresh = continued(ContextShiftCache(m, n_ctx=64, n_keep=4), [], None, longer)
    assert (continued(cache, reused, None, longer) - fresh).abs().max() < TOL
    # the file holds more than one window after decoding in place: a prompt ending inside it loads whole,
    # and generate.run's rewind by one token (to recompute its logits, which the file lacks) recomputes
    g = Generator(m, ContextShiftCache(m, n_ctx=64, n_keep=4))
    g.feed(prompt)
    last = [g.feed([t]) for t in (5, 7, 11, 13)][-1]
    promptcache.save(tmp_path / "q.pt", m, g.cache, g.tokens, last)
    cache = ContextShiftCache(m, n_ctx=64, n_keep=4)
    reused, saved = promptcache.load(tmp_path / "q.pt", m, cache, g.tokens[:42])
    assert reused == g.tokens[:42] and saved is None and not cache.can_truncate(41)
    g2 = Generator(m, cache, tokens=list(reused))
    next(generate.run(g2, reused, 1, (), len(reused), None))
    assert (g2.last_logits - expected[2]).abs().max() < TOL  # after prompt + [5, 7], as computed fresh
    # a version-2 file (every cell of every layer, no positions) still loads
    full = ContextShiftCache(m, n_ctx=64, n_keep=4, sliding=False)
    Generator(m, full).feed(prompt)
    promptcache.save(tmp_path / "full.pt", m, full, prompt, logits)
    old = torch.load(tmp_path / "full.pt", weights_only=True)
    del old["positions"]
    torch.save({**old, "format": "selfextend-prompt-cache/2"}, tmp_path / "v2.pt")
    cache = ContextShiftCache(m, n_ctx=64, n_keep=4)
    reused, saved = promptcache.load(tmp_path / "v2.pt", m, cache, prompt)
    assert reused == prompt and (continued(cache, reused, saved, prompt) - expected).abs().max() < TOL
    # a version-3 file (position ranges "held" per layer) is converted on load
    v3 = torch.load(tmp_path / "p.pt", weights_only=True)
    v3["held"] = [[[0, 4], [23, 30], [33, 40]], [[0, 40]], [[0, 4], [23, 30], [33, 40]]]
    del v3["positions"]
    torch.save({**v3, "format": "selfextend-prompt-cache/3"}, tmp_path / "v3.pt")
    cache = ContextShiftCache(m, n_ctx=64, n_keep=4)
    reused, saved = promptcache.load(tmp_path / "v3.pt", m, cache, prompt)
    assert reused == prompt and (continued(cache, reused, saved, prompt) - expected).abs().max() < TOL


@pytest.fixture(scope="module")
def chat_model(tiny_dir):
    """A tiny Gemma 3 for the default model's tokenizer (its vocabulary and chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    m = tiny_gemma3(KINDS, WINDOW, vocab_size=len(tok), hidden_size=32, intermediate_size=64)
    m.config.max_position_embeddings = 256
    return m, tok


def test_chat_undo_retry_and_session_file_on_hybrid_model(chat_model, tmp_path):
    from selfextend.chat import ChatSession

    m, tok = chat_model
    kw = dict(system="Keep me.", max_new_tokens=12, ignore_eos=True)
    a = ChatSession(m, tok, n_ctx=120, **kw)
    b = ChatSession(m, tok, n_ctx=120, **kw)
    assert isinstance(a.cache.layers[0], SlidingShiftLayer)
    "".join(a.reply("one"))
    first = "".join(a.reply("two"))
    start = a.exchanges[-1].start
    assert not a.cache.can_truncate(start)  # the reply is longer than the window: undo recomputes
    a.undo()
    assert "".join(a.retry()) == "".join(b.reply("one"))  # greedy: the same reply as never having said "two"
    assert "".join(a.reply("two")) == first == "".join(b.reply("two"))
    torch.testing.assert_close(a.gen.last_logits, b.gen.last_logits, atol=TOL, rtol=0)
    for i in range(6):  # through shifts, then undo: as a fresh forward over the kept tokens
        "".join(a.reply(f"turn {i}"))
    assert a.cache.shifts >= 2
    a.undo()
    with torch.no_grad():
        fresh = m(torch.tensor([a.gen.tokens])).logits[0, -1]
    torch.testing.assert_close(a.gen.last_logits, fresh, atol=TOL, rtol=0)
    a.save(tmp_path / "s.pt")
    c = ChatSession(m, tok, n_ctx=120, **kw)
    c.load(tmp_path / "s.pt")
    assert c.gen.tokens == a.gen.tokens and held(c.cache.layers[0]) == held(a.cache.layers[0])
    assert "".join(a.reply("again")) == "".join(c.reply("again"))
    torch.testing.assert_close(a.gen.last_logits, c.gen.last_logits, atol=TOL, rtol=0)


def test_claim_puts_the_ring_in_order_and_the_window_is_its_last_run():
    """Tokens written one by one through the model's forward wrap the ring (slots out of position order);
    claiming a slot compacts it
    first, and then every claim appends in order: the cells a query sees through the window are exactly the
    last ``visible_from`` .. ``n_used`` slots, kept cells included when they come back inside it."""
    m = model()
    cache = ContextShiftCache(m, n_ctx=48, n_keep=4)
    gen = Generator(m, cache, direct_decode=False)
    for token in torch.randint(3, 97, (30,), generator=torch.Generator().manual_seed(5)).tolist():
        gen.feed([token])
    layer = cache.layers[0]
    assert isinstance(layer, SlidingShiftLayer) and not layer.ordered  # 30 cells through a 4 + 14-slot ring
    for _ in range(60):
        cache.make_room(1)  # two shifts on the way: moved cells keep their order
        slot = layer.claim()
        pos = layer.next_pos - 1
        positions = layer.positions[: layer.n_used]
        assert layer.ordered and slot == layer.n_used - 1 and int(positions[slot]) == pos
        assert bool((positions[1:] > positions[:-1]).all())
        first = layer.visible_from(pos, WINDOW)
        visible = torch.nonzero(pos - positions < WINDOW).squeeze(1)
        assert visible.tolist() == list(range(first, layer.n_used))
        for other in cache.layers[1:]:
            other.claim()
    assert cache.shifts >= 2
