"""Cells that carry positions: remove + move (llama.cpp's memory API) against a fresh forward over the kept
tokens at their new positions, the ring-order sliding layer against the all-cells layout, the storage
contract read directly, and refusals.

One-layer models: their cells depend on the token and its position only, so after any remove + move the
next logits must equal a fresh forward over the kept tokens at the positions they now have (``position_ids``
with gaps where cells were removed and nothing moved down). Hybrid models (sliding layers and Self-Extend on
the full ones) are held to the all-cells layout (``sliding=False``) under the same operations.
"""

from __future__ import annotations

import pytest
import torch
from conftest import COMMON, tiny_gemma3
from transformers import LlamaConfig, LlamaForCausalLM

import selfextend
from selfextend.core.attention import repeat_kv
from selfextend.generation.decode import DecodeStep
from selfextend.hf.facts import cache_kwargs
from selfextend.kv.cache import ContextShiftCache
from selfextend.kv.layers import ContextShiftLayer
from selfextend.kv.sliding import SlidingShiftLayer

TOL = 1e-4
WINDOW = 8


def one_layer(kind: str, self_extend: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "full":
        m = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 1})).eval()
    else:
        m = tiny_gemma3(["sliding_attention"], WINDOW)
    if self_extend:
        selfextend.apply_self_extend(m, group_size=3, window=5)
    return m


def forward(m, ids, cache=None, position_ids=None) -> torch.Tensor:
    """Logits (L, vocab); with ``position_ids``, a mask of ones too (without one, transformers reads a jump in
    the positions as the start of another packed sequence)."""
    kw = {}
    if position_ids is not None:
        kw = {"position_ids": position_ids, "attention_mask": torch.ones_like(position_ids)}
    with torch.no_grad():
        return m(torch.tensor([ids]), **cache_kwargs(m, cache), use_cache=cache is not None, **kw).logits[0]


# (operations, the kept token indices in order, their positions[, the next position when past the last kept
# one + 1]): after 40 tokens at positions 0..39
SCENARIOS = {
    "cut-and-close": (
        [("remove", 10, 20), ("move", 20, None, -10)],
        list(range(10)) + list(range(20, 40)),
        None,
    ),
    "gap": (
        [("remove", 10, 20)],
        list(range(10)) + list(range(20, 40)),
        list(range(10)) + list(range(20, 40)),
    ),
    "chunk-up": (
        [("remove", 30, 40), ("move", 20, 30, 5)],
        list(range(30)),
        list(range(20)) + list(range(25, 35)),
    ),
    "reuse": (  # llama-server's --cache-reuse: drop two stretches, move each kept chunk down
        [("remove", 4, 9), ("move", 9, 20, -5), ("remove", 15, 25), ("move", 25, None, -10)],
        list(range(4)) + list(range(9, 20)) + list(range(25, 40)),
        None,
    ),
    # a cut back to inside a gap: the gap stays between the last cell and the next token (issue 30, item 4)
    "gap-then-truncate": ([("remove", 10, 20), ("truncate", 15)], list(range(10)), list(range(10)), 15),
    "gap-then-crop": ([("remove", 30, 38), ("crop", -5)], list(range(30)), list(range(30)), 35),
    "move-up-then-truncate": ([("move", 30, None, 5), ("truncate", 33)], [*range(30)], [*range(30)], 33),
}


def apply(cache: ContextShiftCache, ops) -> None:
    for op, *args in ops:
        getattr(cache, op)(*args)


def continue_after(m, cache: ContextShiftCache, ids: list[int], scenario: str) -> None:
    """Apply ``scenario`` to a cache holding ``ids[:40]``, feed ``ids[40:46]`` in three writes, and hold each
    logits row to a fresh forward over the kept tokens at their new positions."""
    ops, kept, positions, *after = SCENARIOS[scenario]
    apply(cache, ops)
    positions = positions if positions is not None else list(range(len(kept)))
    assert cache.n_past == (after[0] if after else positions[-1] + 1)
    assert cache.can_truncate(cache.n_past)  # every layer holds what the next token attends
    got = torch.cat([forward(m, ids[a:b], cache) for a, b in ((40, 43), (43, 44), (44, 46))])
    tokens = [ids[i] for i in kept] + ids[40:46]
    pos = positions + list(range(cache.n_past - 6, cache.n_past))
    fresh = forward(m, tokens, position_ids=torch.tensor([pos]))[-6:]
    assert (got - fresh).abs().max() < TOL


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("self_extend", [False, True])
def test_remove_move_full_layer_equals_fresh_forward(scenario, self_extend):
    m = one_layer("full", self_extend)
    ids = torch.randint(3, 97, (46,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = ContextShiftCache(m, n_ctx=64, n_keep=4)
    forward(m, ids[:25], cache)
    forward(m, ids[25:40], cache)
    continue_after(m, cache, ids, scenario)


@pytest.mark.parametrize("self_extend", [False, True])
@pytest.mark.parametrize("decode", ["forward", "direct"])
def test_gap_after_truncate_is_kept(self_extend, decode):
    """remove(5, 10) then truncate(7) leaves cells 0..4 and the next token at 7: the layer is not gapless
    (slot 0 is at 0, not next_pos - n_used), before and after the token at 7 claims a cell, and what the next
    queries see follows the positions (the issue's example, through the model's forward and the direct
    decode step)."""
    m = one_layer("full", self_extend)
    ids = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = ContextShiftCache(m, n_ctx=64, n_keep=4)
    forward(m, ids[:15], cache)
    cache.remove(5, 10)
    cache.truncate(7)
    layer = cache.layers[0]
    assert cache.n_past == 7 and not layer.gapless and layer.cells(5).first is None
    step = DecodeStep(m) if decode == "direct" else None
    got = [step(ids[15], cache) if step else forward(m, ids[15:16], cache)[-1]]
    assert layer.positions[: layer.n_used].tolist() == [0, 1, 2, 3, 4, 7] and not layer.gapless
    assert layer.visible_from(7, window=3) == 5 and layer.cells(6).first is None
    got += [step(t, cache) if step else forward(m, [t], cache)[-1] for t in ids[16:18]]
    fresh = forward(m, ids[:5] + ids[15:18], position_ids=torch.tensor([[0, 1, 2, 3, 4, 7, 8, 9]]))[-3:]
    assert (torch.stack(got) - fresh).abs().max() < TOL


@pytest.mark.parametrize("scenario", ["cut-and-close", "gap"])
def test_remove_move_sliding_layer_equals_fresh_forward(scenario):
    m = one_layer("sliding", self_extend=False)
    ids = torch.randint(3, 97, (46,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = ContextShiftCache(m, n_ctx=64, n_keep=4)
    assert isinstance(cache.layers[0], SlidingShiftLayer)
    forward(m, ids[:25], cache)
    for t in ids[25:40]:  # decoded: the ring has overwritten old cells
        forward(m, [t], cache)
    continue_after(m, cache, ids, scenario)


def test_sliding_layer_knows_what_it_lost():
    m = one_layer("sliding", self_extend=False)
    cache = ContextShiftCache(m, n_ctx=64, n_keep=4)
    forward(m, list(range(3, 43)), cache)  # 40 tokens at once: the layer keeps 0..3 and 33..39
    held = sorted(cache.layers[0].positions[: cache.layers[0].n_used].tolist())
    assert held == [0, 1, 2, 3, *range(33, 40)]
    assert cache.can_truncate(4) and not cache.can_truncate(35)
    cache.remove(35)  # cut without checking: the window before position 35 is gone, and the cache says so
    assert cache.n_past == 35 and not cache.can_truncate(35)
    cache.remove(4)
    assert cache.n_past == 4 and cache.can_truncate(4)


@pytest.mark.parametrize("self_extend", [False, True])
def test_hybrid_remove_move_equals_all_cells_layout(self_extend):
    m = tiny_gemma3(["sliding_attention", "full_attention", "sliding_attention"], WINDOW)
    if self_extend:
        selfextend.apply_self_extend(m, group_size=3, window=5)
    ids = torch.randint(3, 97, (46,), generator=torch.Generator().manual_seed(3)).tolist()
    results = []
    for sliding in (True, False):
        cache = ContextShiftCache(m, n_ctx=64, n_keep=4, sliding=sliding)
        forward(m, ids[:25], cache)
        for t in ids[25:40]:
            forward(m, [t], cache)
        apply(cache, SCENARIOS["reuse"][0])
        results.append(torch.cat([forward(m, ids[40:43], cache), forward(m, ids[43:46], cache)]))
    assert (results[0] - results[1]).abs().max() < TOL


def _attend_from_storage(layer, q: torch.Tensor, p: int) -> torch.Tensor:
    """One query (1, H, 1, D) at position ``p`` against a layer's storage, masked as the contract says."""
    k, v, pos = layer.keys[..., : layer.n_used, :], layer.values[..., : layer.n_used, :], layer.positions
    pos = pos[: layer.n_used]
    visible = pos <= p
    if layer.window is not None:
        visible &= p - pos < layer.window
    n_rep = q.shape[1] // k.shape[1]
    scores = (q @ repeat_kv(k, n_rep).transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ repeat_kv(v, n_rep)


def test_ring_order_sliding_layer_equals_all_cells_layout():
    """Decoding through >= 5 shifts: the sliding layers' cells go out of position order in their slots (a
    ring), the logits equal the all-cells layout's at every step, and attention read straight from the
    storage (keys, values, positions, n_used, masked by position) equals it from the all-cells storage."""
    m = tiny_gemma3(["sliding_attention", "full_attention", "sliding_attention"], WINDOW)
    ids = torch.randint(3, 97, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    ring = ContextShiftCache(m, n_ctx=48, n_keep=4)
    flat = ContextShiftCache(m, n_ctx=48, n_keep=4, sliding=False)
    assert isinstance(ring.layers[0], SlidingShiftLayer) and isinstance(flat.layers[0], ContextShiftLayer)
    out_of_order = 0
    q = torch.randn(1, COMMON["num_attention_heads"], 1, 16)
    for i, t in enumerate(ids):
        if i >= 20:
            for c in (ring, flat):
                c.make_room(1)
        a, b = forward(m, [t], ring), forward(m, [t], flat)
        assert (a - b).abs().max() < TOL
        pos = ring.layers[0].positions[: ring.layers[0].n_used]
        out_of_order += bool((pos[1:] < pos[:-1]).any())
        flat.layers[0].window = WINDOW  # read the all-cells storage with the sliding layer's mask
        got, want = (
            _attend_from_storage(ring.layers[0], q, ring.n_past),
            _attend_from_storage(flat.layers[0], q, flat.n_past),
        )
        flat.layers[0].window = None
        assert (got - want).abs().max() < TOL
    assert ring.shifts >= 5 and ring.shifts == flat.shifts and out_of_order > 20


def test_full_layer_keeps_increasing_positions_and_refuses_collisions():
    m = one_layer("full", self_extend=False)
    cache = ContextShiftCache(m, n_ctx=64, n_keep=4)
    forward(m, list(range(3, 33)), cache)
    layer = cache.layers[0]
    keys = layer.keys[..., :30, :].clone()
    with pytest.raises(ValueError, match="share a position"):
        cache.move(20, 25, -3)  # onto 17..19
    with pytest.raises(ValueError, match="below 0"):
        cache.move(0, 5, -1)
    assert torch.equal(layer.keys[..., :30, :], keys) and layer.positions[:30].tolist() == list(range(30))
    cache.remove(5, 10)
    cache.move(20, None, 30)  # positions 20..29 -> 50..59, past a gap
    cache.move(50, 55, -45)  # 50..54 -> 5..9, into the gap: the slots are sorted again
    pos = layer.positions[: layer.n_used].tolist()
    assert pos == [*range(20), *range(55, 60)] and cache.n_past == 60 and not layer.gapless
    with pytest.raises(ValueError):
        cache.remove(-1)
