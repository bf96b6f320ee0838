"""Each layer's cells as the compiled decode step takes them, from a :class:`ContextShiftCache`.

The step's contract: per layer, the keys and values (B, Hkv, n, D) of the cells a query may see, their
positions (n,) int64, and the slot (1,) where the new token's key and value go (its position there is
the query's). A cell is visible to the query at ``p`` iff its position is at most ``p`` (and, on a
sliding layer, ``p - position < window``), whatever its slot. This adapter derives that from today's
layers: a full layer holds positions ``0 .. n_past - 1`` in slots of the same number; a sliding layer
holds the kept positions in slots ``[0, n_keep)`` and positions ``start ..`` from slot ``n_keep`` on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from selfextend.kv.cache import ContextShiftCache
from selfextend.kv.layers import SlidingShiftLayer


class Cells(NamedTuple):
    """What the step reads and writes: per layer the whole key and value buffers (B, Hkv, capacity, D) and
    the positions (n,) of the first ``n`` slots (the ones in use, the new token's included), and the slot
    (one per layer, (L,)) where the new token's key and value go."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    slots: torch.Tensor


class StepCells:
    """Hands out the cells of the next token at ``cache.n_past`` and records the write after the step."""

    def __init__(self, cache: ContextShiftCache) -> None:
        self.cache = cache
        keys = cache.layers[0].keys
        capacity = max(layer.capacity for layer in cache.layers)
        self.slots = torch.arange(capacity, device=keys.device)  # also the positions of a full layer's slots
        self.sliding: dict[tuple[int, int], torch.Tensor] = {}  # (n_keep, start) -> positions of the slots

    def _sliding_positions(self, layer: SlidingShiftLayer) -> torch.Tensor:
        key = (layer.n_keep, layer.start)
        found = self.sliding.get(key)
        if found is None:
            self.sliding.clear()  # every sliding layer has the same start: one entry is all that is used
            s = self.slots[: layer.capacity]
            found = self.sliding[key] = torch.where(s < layer.n_keep, s, s - layer.n_keep + layer.start)
        return found

    def prepare(self) -> Cells | None:
        """Every layer's cells with a free slot for the next token, or None where the token would take a
        layer's last slot (or a sliding layer must first move its cells, which its
        :meth:`~SlidingShiftLayer.update` does): a step through the model's forward then. The last slot is
        left out so that the cells in use are always a strict part of the buffer: a graph compiled for that
        (strided) case then serves every step."""
        keys, values, positions, slots = [], [], [], []
        for layer in self.cache.layers:
            if isinstance(layer, SlidingShiftLayer):
                slot, held = layer.used, self._sliding_positions(layer)
            else:
                slot, held = layer.n_past, self.slots
            if slot + 1 >= layer.capacity:
                return None
            keys.append(layer.keys)
            values.append(layer.values)
            positions.append(held[: slot + 1])
            slots.append(slot)
        return Cells(keys, values, positions, torch.tensor(slots, device=self.slots.device))

    def commit(self) -> None:
        """Record the token the step wrote into every layer."""
        for layer in self.cache.layers:
            layer.n_past += 1
            if isinstance(layer, SlidingShiftLayer):
                layer.used += 1
