"""The prompt store (``--cache-ram``): a conversation whose slot went to another one comes back from memory.

Oracles: a fresh forward over the whole prompt (a conversation read back from the store must give the
logits it would give computed from scratch), the store's own byte count against the cells it copied, and
the server's usage and /metrics through a real loopback socket.
"""

from __future__ import annotations

import pytest
import torch
from conftest import COMMON
from server_util import request, serving
from test_server_llama_api import metrics
from test_server_slots import fresh_logits, one_layer, tokens
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from selfextend.server.promptstore import PromptStore
from selfextend.server.slots import Slot


def serve_one(slot: Slot, store: PromptStore, prompt: list[int], n_keep: int = 0) -> torch.Tensor:
    """What the engine does with a prompt on ``slot``: swap, prepare, read the rest, record it."""
    store.swap(slot, prompt)
    reuse = slot.prepare(prompt, n_keep, min_chunk=4)
    gen = slot.gen
    logits = gen.feed(prompt[reuse.tokens :]) if reuse.tokens < len(prompt) else gen.last_logits
    slot.finish(prompt, [], True)
    return logits


@pytest.mark.parametrize("self_extend", [False, True])
def test_a_conversation_comes_back_exactly(self_extend):
    """A, then B on the same slot (A goes to the store), then A grown by a turn: A's cells come back and
    only the new turn is computed; the logits are a fresh forward's over the whole of it."""
    model = one_layer(self_extend)
    slot, store = Slot(0, model, n_ctx=96), PromptStore(budget=2**30, min_tokens=8)
    a, b = tokens(40, 1), tokens(36, 2)
    serve_one(slot, store, a)
    assert store.entries == []  # the slot still holds A
    serve_one(slot, store, b)
    assert [e.tokens for e in store.entries] == [a]
    grown = a + tokens(9, 3)
    logits = serve_one(slot, store, grown)
    assert (store.hits, store.restored) == (1, len(a))
    assert slot.gen.tokens == grown and [e.tokens for e in store.entries] == [b]  # B stored in its turn
    torch.testing.assert_close(logits, fresh_logits(model, grown), atol=2e-5, rtol=1e-5)


def test_a_shifted_conversation_comes_back_through_its_history():
    """A prompt longer than the cache (read through shifts): stored with its history, it is continued as the
    slot's own would be, and a later turn equals one sequential feed of everything."""
    model = one_layer(True)
    slot, store = Slot(0, model, n_ctx=40), PromptStore(budget=2**30, min_tokens=8)
    keep, a = 5, tokens(70, 4)
    slot.generator(keep).feed(a, chunk=8)
    slot.finish(a, [], True)
    serve_one(slot, store, tokens(30, 5), keep)
    more = a + tokens(6, 6)
    store.swap(slot, more)
    assert store.hits == 1 and store.restored == len(a) and slot.history == a
    assert slot.prepare(more, keep, min_chunk=4).tokens == len(a)


def test_the_budget_holds_and_the_least_recent_goes_first():
    model = one_layer(False)
    slot = Slot(0, model, n_ctx=64)
    conversations = [tokens(30, 10 + i) for i in range(4)]
    probe = PromptStore(budget=2**30, min_tokens=8)
    serve_one(slot, probe, conversations[0])
    probe.keep(slot)
    size = probe.entries[0].nbytes
    cells, layers = slot.gen.cache.layers[0], len(model.model.layers)
    cell_bytes = 2 * cells.keys[..., :1, :].numel() * cells.keys.element_size()
    position_bytes = cells.positions.element_size()
    logit_bytes = model.config.vocab_size * slot.gen.last_logits.element_size()
    assert size == layers * 30 * (cell_bytes + position_bytes) + logit_bytes
    store = PromptStore(budget=2 * size + size // 2, min_tokens=8)  # room for two
    slot.reset()
    for c in conversations:
        serve_one(slot, store, c)
    assert [e.tokens for e in store.entries] == conversations[1:3] and store.nbytes <= store.budget
    short = PromptStore(budget=size - 1, min_tokens=8)  # room for none
    serve_one(slot, short, tokens(30, 20))
    assert short.entries == [] and short.nbytes == 0
    few = PromptStore(budget=2**30, min_tokens=31)  # too short to keep
    serve_one(slot, few, tokens(30, 21))
    assert few.entries == []


def test_the_same_conversation_is_not_stored_again():
    """A slot whose next prompt keeps most of what it holds (a changed last reply) stores nothing; one that
    a stored conversation already holds all of is not stored twice."""
    model = one_layer(False)
    slot, store = Slot(0, model, n_ctx=96), PromptStore(budget=2**30, min_tokens=8)
    a = tokens(40, 7)
    serve_one(slot, store, a)
    serve_one(slot, store, a[:35] + tokens(8, 8))
    assert store.entries == []
    store.keep(slot)
    store.keep(slot)
    assert len(store.entries) == 1


def test_served_conversations_beyond_the_slots_come_back(tiny_dir):
    """One slot, two conversations in turns, over a real socket: the third request (the first conversation
    again) takes its prompt from the store: usage says cached, /metrics counts the hit."""
    model = LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    model.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    first = "Once upon a time there was a ship that sailed the sea, far from any shore we know of. " * 2
    other = "The weather report for the coast says rain in the morning and wind after noon, then sun. " * 2
    with serving(model, tok, n_ctx=256, parallel=1, max_tokens=32, cache_ram=2**26) as (base, _):
        answers = []
        for text in (first, other, first + "And then?"):
            body = {"prompt": text, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            status, answer = request(base, "POST", "/v1/completions", body)
            assert status == 200
            answers.append(answer)
        held = metrics(base)
    n = answers[0]["usage"]["prompt_tokens"]
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] < 5  # nothing of the first
    assert answers[2]["usage"]["prompt_tokens_details"]["cached_tokens"] >= n - 2
    assert (
        held["llamacpp:prompt_store_hits_total"] == 1 and held["llamacpp:prompt_store_tokens_total"] >= n - 2
    )
    assert held["llamacpp:prompt_store_bytes"] > 0


def test_a_load_failing_midway_leaves_the_slot_empty(monkeypatch):
    """Item 6: a stored conversation's load that fails after some layers took its cells (a MemoryError, not
    the ValueError of cells that do not fit): the slot is left empty, never holding the stored cells under
    the old tokens, and a prompt sharing the stored prefix gets a fresh forward's logits."""
    from selfextend.kv.cache import ContextShiftCache

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 2})).eval()
    slot, store = Slot(0, model, n_ctx=96), PromptStore(budget=2**30, min_tokens=8)
    a, b = tokens(40, 1), tokens(36, 2)
    serve_one(slot, store, a)
    serve_one(slot, store, b)  # A goes to the store
    real = ContextShiftCache.load_prefix

    def half(self, keys, values, n_past, positions=None):
        self.layers[0].fill(keys[0], values[0], positions[0], n_past)
        raise MemoryError("injected")

    monkeypatch.setattr(ContextShiftCache, "load_prefix", half)
    with pytest.raises(MemoryError):
        store.swap(slot, a + tokens(5, 3))
    monkeypatch.setattr(ContextShiftCache, "load_prefix", real)
    assert slot.gen.tokens == [] and slot.history == []
    assert all(layer.n_used == 0 and layer.next_pos == 0 for layer in slot.gen.cache.layers)
    prompt = a[:20] + tokens(6, 4)
    torch.testing.assert_close(
        serve_one(slot, store, prompt), fresh_logits(model, prompt), atol=2e-5, rtol=1e-5
    )


def test_the_byte_count_holds_every_tensor_kept():
    """Item 6: an entry's bytes are those of every tensor it keeps, counted by hand for the one-layer tiny
    Llama (2 KV heads of 16, float32 cells, a vocabulary of 97) after a prompt of 30 tokens in 64 cells:
    the 30 cells' keys and values, their 30 int64 positions and the last logits; not the 64 cells'
    buffers."""
    model = one_layer(False)
    slot, store = Slot(0, model, n_ctx=64), PromptStore(budget=2**30, min_tokens=8)
    serve_one(slot, store, tokens(30, 10))
    store.keep(slot)
    (e,) = store.entries
    assert e.logits is not None and e.positions
    keys = values = 2 * 30 * 16 * 4  # KV heads x cells x head size x float32
    assert e.nbytes == keys + values + 30 * 8 + 97 * 4 == 8308
    assert store.nbytes == 8308
