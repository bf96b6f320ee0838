"""Each layer's cells as the compiled decode step takes them, from a :class:`ContextShiftCache`.

The step's contract: per layer, the keys and values buffers (B, Hkv, capacity, D), the positions (n,) int64
of the first ``n`` slots (the cells in use and the new token's), and the slot where the new token's key
and value go (its position there is the query's). A cell is visible to the query at ``p`` iff its position
is at most ``p`` (and, on a sliding layer, ``p - position < window``), whatever its slot. The cache's layers
keep exactly that: ``positions`` per cell and ``n_used`` cells in slots ``[0, n_used)``; a sliding layer's
ring is compacted (:meth:`~selfextend.kv.layers.SlidingShiftLayer.compact`) when it has no free slot left.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from selfextend.kv.cache import ContextShiftCache
from selfextend.kv.sliding import SlidingShiftLayer


class Cells(NamedTuple):
    """What the step reads and writes: per layer the whole key and value buffers (B, Hkv, capacity, D) and
    the positions (n,) of the first ``n`` slots (the ones in use, the new token's included), and the slot
    (one per layer, (L,)) where the new token's key and value go; ``grouped``: per layer the keys at their
    Self-Extend grouped positions (B, Hkv, capacity, D) where the cache keeps them current, else None (the
    step rotates them)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    slots: torch.Tensor
    grouped: list[torch.Tensor | None] | None = None


class StepCells:
    """Hands out the cells of the next token at ``cache.n_past`` and records the write after the step."""

    def __init__(self, cache: ContextShiftCache) -> None:
        self.cache = cache

    def prepare(self) -> Cells | None:
        """Every layer's cells with a free slot for the next token (its position already recorded there), or
        None where the token would take a full layer's last slot: a step through the model's forward then.
        The last slot is left out so that the cells in use are always a strict part of the buffer: a graph
        compiled for that (strided) case then serves every step."""
        keys, values, positions, slots = [], [], [], []
        for layer in self.cache.layers:
            if isinstance(layer, SlidingShiftLayer) and layer.n_used + 1 >= layer.capacity:
                layer.compact()
            slot = layer.n_used
            if slot + 1 >= layer.capacity:
                return None
            keys.append(layer.keys)
            values.append(layer.values)
            layer.positions[slot] = layer.next_pos
            positions.append(layer.positions[: slot + 1])
            slots.append(slot)
        return Cells(keys, values, positions, torch.tensor(slots, device=self.cache.layers[0].keys.device))

    def commit(self) -> None:
        """Record the token the step wrote into every layer."""
        for layer in self.cache.layers:
            layer.grouped.invalidate(layer.n_used)
            layer.n_used += 1
            layer.next_pos += 1
