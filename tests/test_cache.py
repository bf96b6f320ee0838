"""Context-shift cache on tiny models: exact logits after shifts, kept tokens untouched, no reallocation."""

from __future__ import annotations

import pytest
import torch
from conftest import COMMON, ROPE_TYPES, TRAINED
from transformers import LlamaConfig, LlamaForCausalLM

import selfextend
from selfextend.core.rope import rotate
from selfextend.core.validate import ValidationError
from selfextend.generation.generator import Generator
from selfextend.kv.cache import ContextShiftCache, default_keep

TOL = 1e-4


def one_layer_model(rope: str) -> torch.nn.Module:
    """One layer: its keys and values depend on the token alone, so a fresh forward over the kept
    tokens must reproduce the shifted cache exactly (deeper layers also carry the dropped context)."""
    torch.manual_seed(0)
    extra = {"max_position_embeddings": 4 * TRAINED} if rope in ("llama3", "yarn") else {}
    return LlamaForCausalLM(
        LlamaConfig(**{**COMMON, "num_hidden_layers": 1, **ROPE_TYPES[rope], **extra})
    ).eval()


@pytest.mark.parametrize("rope", sorted(ROPE_TYPES))
@pytest.mark.parametrize("self_extend", [False, True])
@pytest.mark.parametrize("steps", [25, 110])  # one shift, several shifts
def test_logits_after_shifts_equal_fresh_forward(rope, self_extend, steps):
    model = one_layer_model(rope)
    if self_extend:
        selfextend.apply_self_extend(model, group_size=3, window=7)
    cache = ContextShiftCache(model, n_ctx=40, n_keep=5)
    gen = Generator(model, cache)
    ids = torch.randint(3, 97, (20 + steps,)).tolist()
    logits = gen.feed(ids[:20])
    for t in ids[20:]:
        logits = gen.feed([t])
    assert cache.shifts >= (1 if steps == 25 else 5)
    assert gen.tokens[:5] == ids[:5] and gen.tokens[-1] == ids[-1] and len(gen.tokens) == cache.n_past
    with torch.no_grad():
        fresh = model(torch.tensor([gen.tokens])).logits[0, -1]
    assert (logits - fresh).abs().max() < TOL


def test_kept_tokens_bit_identical_and_storage_fixed():
    from conftest import make_model

    model = make_model("llama")
    cache = ContextShiftCache(model, n_ctx=32, n_keep=6)
    gen = Generator(model, cache)
    ids = torch.randint(3, 97, (200,)).tolist()
    gen.feed(ids[:10])
    kept_k = [layer.keys[..., :6, :].clone() for layer in cache.layers]
    kept_v = [layer.values[..., :6, :].clone() for layer in cache.layers]
    storage = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    for t in ids[10:]:
        gen.feed([t])
    assert cache.shifts > 5
    for layer, k, v, ptrs in zip(cache.layers, kept_k, kept_v, storage, strict=True):
        assert torch.equal(layer.keys[..., :6, :], k) and torch.equal(layer.values[..., :6, :], v)
        assert (layer.keys.data_ptr(), layer.values.data_ptr()) == ptrs
        assert layer.keys.shape[-2] == 32


def test_large_chunk_is_fed_in_pieces_not_truncated():
    from conftest import make_model

    model = make_model("llama")
    cache = ContextShiftCache(model, n_ctx=32, n_keep=4)
    gen = Generator(model, cache)
    ids = torch.randint(3, 97, (100,)).tolist()
    gen.feed(ids)
    assert cache.shifts >= 1 and gen.tokens[:4] == ids[:4] and gen.tokens[-1] == ids[-1]
    with pytest.raises(ValueError, match="at once"):
        cache.make_room(40)
    with pytest.raises(ValidationError, match="n_new must be an integer >= 0, got -5"):
        cache.make_room(-5)  # was 0 shifts, without a word


@pytest.mark.parametrize("args", [(-3, 10, 64), (0, -1, 64), (0, 10, 2.5), (True, 10, 64)])
def test_default_keep_refuses_counts_that_are_not_counts(args):
    with pytest.raises(ValidationError):
        default_keep(*args)  # (-3, 10, 64) answered -3


def test_shift_drift_after_many_rotations():
    """Keys moved by many small shifts stay close to a single rotation by the total (float32)."""
    d = 64
    inv_freq = 1.0 / (100000 ** (torch.arange(0, d, 2).float() / d))
    k = rotate(torch.randn(1, 3, 1, d), torch.tensor([16000]), inv_freq)
    stepwise = k
    for _ in range(100):
        stepwise = rotate(stepwise, torch.tensor([-150]), inv_freq)
    once = rotate(k, torch.tensor([-15000]), inv_freq)
    assert (stepwise - once).abs().max() < 1e-3


@pytest.mark.parametrize("n_ctx,n_keep", [(0, 0), (-5, 0), (10, 10), (10, 12)])
def test_bad_sizes_refused(n_ctx, n_keep):
    from conftest import make_model

    with pytest.raises(ValueError):
        ContextShiftCache(make_model("llama"), n_ctx=n_ctx, n_keep=n_keep)


def test_grouped_keys_kept_by_the_cache_match_recomputation_across_shifts(monkeypatch):
    """Self-Extend decoding reads the grouped keys each full layer keeps in step with its cells; across
    context shifts that must equal rotating every grouped key anew at each step."""
    from conftest import make_model

    from selfextend.core.cells import KeyCells
    from selfextend.kv.layers import ContextShiftLayer

    ids = torch.randint(3, 97, (160,)).tolist()
    runs = []
    for kept in (True, False):
        if not kept:  # the layers give their positions only: the kernels rotate every grouped key themselves
            monkeypatch.setattr(
                ContextShiftLayer, "cells", lambda self, end: KeyCells(self.positions[:end], None)
            )
        model = make_model("qwen3")
        selfextend.apply_self_extend(model, group_size=3, window=9)
        gen = Generator(model, ContextShiftCache(model, n_ctx=48, n_keep=3))
        logits = [gen.feed(ids[:20])] + [gen.feed([t]) for t in ids[20:]]
        runs.append(torch.stack(logits))
        assert gen.cache.shifts >= 5
        assert (gen.cache.layers[0].grouped.valid > 0) == kept
    assert (runs[0] - runs[1]).abs().max() < TOL


def test_grouped_keys_rotate_ahead_of_the_query() -> None:
    """Asked for 10 grouped keys with 100 written, the buffer rotates AHEAD more at once (a decode step's
    query then asks for one more per step without a rotation), each equal to a rotation of its own."""
    from selfextend.core.decode_query import grouped_keys
    from selfextend.kv.grouped import AHEAD, GroupedKeys

    keys = torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(128) + 7
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    grouped = GroupedKeys()
    got = grouped.get(keys, positions, 4, inv_freq, 10, ready=100)
    assert got.shape[2] == 10 and grouped.valid == 10 + AHEAD
    want = grouped_keys(keys[..., :74, :], positions[:74], 4, inv_freq)
    torch.testing.assert_close(grouped.buf[..., :74, :], want)
    grouped.get(keys, positions, 4, inv_freq, 70, ready=72)  # nothing more to rotate
    assert grouped.valid == 74
    grouped.invalidate(30)  # a write at slot 30: rotated again from there, never past the written slots
    grouped.get(keys, positions, 4, inv_freq, 40, ready=50)
    assert grouped.valid == 50


def test_grouped_keys_known_at_once_only_where_current() -> None:
    """A decode step asks each layer for its grouped keys without a torch call (grouped_now): the layer's
    own buffer and how many keys the query scores at grouped positions, only where the buffer holds them
    rotated for these settings; None where a rotation or a search over the positions is due."""
    from selfextend.core.decode_query import grouped_keys
    from selfextend.kv.layers import ContextShiftLayer

    gen = torch.Generator().manual_seed(0)
    layer = ContextShiftLayer(
        torch.randn(1, 2, 64, 16, generator=gen), torch.randn(1, 2, 64, 16, generator=gen)
    )
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    layer.claim(40)  # positions 0..39; the query at 40 scores 33 keys (distance >= 8) at grouped positions
    assert layer.grouped_now(40, 4, 8, inv_freq) is None  # none rotated yet
    layer.cells(40).grouped(4, inv_freq, 33, None)  # what the decode step's slower path asks for
    buffer, n_g = layer.grouped_now(40, 4, 8, inv_freq)
    assert n_g == 33 and buffer is layer.grouped.buf
    want = grouped_keys(layer.keys[..., :33, :], layer.positions[:33], 4, inv_freq)
    assert torch.equal(buffer[..., :33, :], want)
    assert layer.grouped_now(7, 4, 8, inv_freq) == (None, 0)  # every key a neighbor
    assert layer.grouped_now(40, 2, 8, inv_freq) is None  # another group size
    assert layer.grouped_now(40, 4, 8, inv_freq * 2) is None  # other frequencies
    layer.grouped.invalidate(20)  # a write at slot 20
    assert layer.grouped_now(40, 4, 8, inv_freq) is None
    assert layer.grouped_now(27, 4, 8, inv_freq)[1] == 20  # still held below it
    layer.remove(5, 6)  # a gap: the positions must be searched
    assert layer.first_position is None and layer.grouped_now(40, 4, 8, inv_freq) is None


@pytest.mark.parametrize("start", [0, 5], ids=["from-0", "after-a-shift"])
def test_truncating_a_gapless_tail_is_the_searched_removal(start: int) -> None:
    """A gapless full layer drops its last cells without searching the positions (a speculative check's
    refused drafts): the same cells, positions, lost range, gaplessness and grouped keys held as the search
    over the positions leaves; a cut before its first cell or with a gap takes the search."""
    from selfextend.kv.layers import CellLayer, ContextShiftLayer

    def layer() -> ContextShiftLayer:
        gen = torch.Generator().manual_seed(1)
        out = ContextShiftLayer(
            torch.randn(1, 2, 32, 8, generator=gen), torch.randn(1, 2, 32, 8, generator=gen)
        )
        out.claim(20)
        if start:
            out.remove(0, start)  # cells start..19 left: still gapless, the first at start
        return out

    def state(x: ContextShiftLayer) -> tuple:
        return x.n_used, x.next_pos, x.lost, x.gapless, x.grouped.valid, x.positions[: x.n_used].tolist()

    for n_past in (max(0, start - 3), start, start + 3, 19, 20):
        fast, searched = layer(), layer()
        fast.truncate(n_past)
        CellLayer.truncate(searched, n_past)
        assert state(fast) == state(searched), n_past
        assert torch.equal(fast.keys[..., : fast.n_used, :], searched.keys[..., : searched.n_used, :])
        fast.claim(2), searched.claim(2)
        assert state(fast) == state(searched), n_past
