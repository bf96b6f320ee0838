"""Server slots: what a prompt reuses from a slot's cache, held against a fresh forward over the prompt.

A one-layer model, so that a cell's key and value depend only on its token and position: after chunks
are moved by K-shift (or the cache shifted), the next logits must equal those of a fresh forward over
the tokens at their new positions (a deeper layer's cells also carry what the removed tokens said).
"""

from __future__ import annotations

import pytest
import torch
from conftest import COMMON
from transformers import LlamaConfig, LlamaForCausalLM

import selfextend
from selfextend.generation.generator import Generator
from selfextend.kv.cache import ContextShiftCache
from selfextend.server.slots import Slot, pick

VOCAB = COMMON["vocab_size"]


def one_layer(self_extend: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 1})).eval()
    if self_extend:
        selfextend.apply_self_extend(model, group_size=3, window=7)
    return model


def fresh_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


@pytest.mark.parametrize("self_extend", [False, True])
def test_front_trimmed_prompt_reuses_moved_chunks_exactly(self_extend):
    """A client cuts two old messages after the system part: the rest is moved, not recomputed."""
    model = one_layer(self_extend)
    system, m = tokens(6, 1), [tokens(9, 10 + i) for i in range(5)]
    first = system + m[0] + m[1] + m[2] + m[3]
    slot = Slot(0, model, n_ctx=60)
    gen = slot.generator(len(system))
    gen.feed(first)
    slot.finish(first, [], True)
    second = system + m[2] + m[3] + m[4]
    reuse = slot.prepare(second, len(system), min_chunk=4)
    assert (reuse.prefix, reuse.moved, reuse.chunks) == (6, 18, 1)
    assert gen.tokens == second[:24] and gen.cache.n_past == 24
    logits = gen.feed(second[24:])
    torch.testing.assert_close(logits, fresh_logits(model, second), atol=2e-5, rtol=1e-5)


def test_two_chunks_and_short_matches_left_alone():
    model = one_layer(False)
    a, b, c, d, e = (tokens(8, s) for s in range(20, 25))
    slot = Slot(0, model, n_ctx=80)
    gen = slot.generator(0)
    old = a + b + c + d
    gen.feed(old)
    slot.finish(old, [], True)
    new = a + c + e[:2] + d + e  # c moves down by 8; d is found again after two new tokens
    reuse = slot.prepare(new, 0, min_chunk=4)
    assert (reuse.prefix, reuse.moved, reuse.chunks) == (8, 8, 1)  # d is not at its place: recomputed
    logits = gen.feed(new[reuse.tokens :])
    torch.testing.assert_close(logits, fresh_logits(model, new), atol=2e-5, rtol=1e-5)
    slot.finish(new, [], True)
    # chunks shorter than min_chunk are recomputed
    reuse = slot.prepare(a + e, 0, min_chunk=9)
    assert (reuse.prefix, reuse.moved) == (8, 0) and gen.tokens == a


def test_prefix_only_without_cache_reuse():
    model = one_layer(False)
    slot = Slot(0, model, n_ctx=64)
    gen = slot.generator(0)
    old = tokens(30, 3)
    gen.feed(old)
    slot.finish(old, [], True)
    new = old[:10] + old[15:]
    reuse = slot.prepare(new, 0, min_chunk=0)
    assert reuse.tokens == 10 and gen.tokens == old[:10]


def test_history_continues_through_shifts():
    """A prompt that goes on from a shifted cache's history reuses all of it: same logits as one
    sequential feed of everything (the chat's way)."""
    model = one_layer(True)
    n_ctx, keep = 40, 5
    prompt = tokens(70, 4)  # longer than the cache: read through shifts
    slot = Slot(0, model, n_ctx=n_ctx)
    gen = slot.generator(keep)
    gen.feed(prompt, chunk=8)
    assert gen.cache.shifts > 0
    slot.finish(prompt, [], True)
    more = prompt + tokens(12, 5)
    assert slot.score(more) == len(prompt)
    reuse = slot.prepare(more, keep, min_chunk=4)
    assert reuse.tokens == len(prompt)
    logits = gen.feed(more[len(prompt) :], chunk=8)
    assert gen.tokens[:keep] == prompt[:keep] and gen.tokens[-12:] == more[-12:]
    torch.testing.assert_close(logits, fresh_logits(model, gen.tokens), atol=2e-5, rtol=1e-5)


def test_pick_prefers_the_slot_holding_most():
    model = one_layer(False)
    slots = [Slot(i, model, n_ctx=64) for i in range(3)]
    shared = tokens(20, 6)
    for s, n in zip(slots, (5, 15, 10), strict=True):
        s.generator(0).feed(shared[:n])
        s.finish(shared[:n], [], True)
    assert pick(slots, shared).id == 1
    slots[1].busy = True
    assert pick(slots, shared).id == 2
    assert pick(slots, shared, wanted=1) is None
    assert pick(slots, shared, wanted=0).id == 0


def test_remove_move_refuses_what_it_cannot_do():
    model = one_layer(False)
    cache = ContextShiftCache(model, n_ctx=32)
    gen = Generator(model, cache, direct_decode=False)
    gen.feed(tokens(20, 7))
    with pytest.raises(ValueError):
        cache.move(10, 20, -5)  # no gap to close
    cache.remove(5, 10)
    with pytest.raises(ValueError):
        cache.move(12, 20, -5)  # not the gap's closing move
    cache.move(10, 20, -5)
    assert cache.n_past == 15
    cache.remove(10, 99)  # the tail: a truncation
    assert cache.n_past == 10


def test_request_sampling_fields_reach_the_sampler():
    """Every OpenAI / llama.cpp sampling field of a request lands in SamplingParams (penalties included)."""
    from selfextend.generation.sampling import SamplingParams
    from selfextend.server.schemas import CompletionRequest, sampling_params

    request = CompletionRequest(
        prompt="x",
        temperature=0.5,
        top_k=7,
        top_p=0.9,
        min_p=0.1,
        repeat_penalty=1.2,
        repeat_last_n=16,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
    )
    got = sampling_params(request, SamplingParams(), None)
    assert got == SamplingParams(0.5, 7, 0.9, 0.1, 1.2, 16, 0.5, -0.25)
    assert (
        sampling_params(
            CompletionRequest(prompt="x", top_p=1e-6), SamplingParams(temperature=0.8), None
        ).temperature
        == 0
    )
