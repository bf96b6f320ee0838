"""A sliding-window layer's cells: the kept ones and the window, in a ring of slots (Gemma 3's local layers).

The storage contract is :mod:`selfextend.kv.layers`'s; slots may be in any position order here, and
:attr:`SlidingShiftLayer.ordered` says when they are in increasing order (a decode step that reads a
contiguous run of slots compacts the ring first: :meth:`SlidingShiftLayer.claim`).
"""

from __future__ import annotations

import torch

from selfextend.core.cells import KeyCells, tag_cells
from selfextend.kv.layers import CellLayer


class SlidingShiftLayer(CellLayer):
    """A sliding-window layer: the kept cells (positions below ``n_keep``, which a shift brings back into the
    window) and at least the last ``window - 1``, in a ring of ``capacity`` slots in any order.

    A write keeps the new cells that later queries can still attend, overwriting first the oldest cells no
    query can see any more (positions from ``n_keep`` up to ``next_pos - window``).
    """

    is_sliding = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, window: int, n_keep: int) -> None:
        super().__init__(keys, values, n_keep)
        self.window = window
        self.ordered = True  # slots [0, n_used) in increasing position order (the ring has not wrapped)

    def _free(self, n: int) -> int:
        """Compact (:meth:`compact`) where the cells are out of order or ``n`` do not fit: appended cells then
        keep the slots in position order."""
        if not self.ordered or self.n_used + n > self.capacity:
            self.compact()
        return self.n_used

    def _order(self) -> None:
        pos = self.positions[: self.n_used]
        self.ordered = self.n_used < 2 or bool((pos[1:] > pos[:-1]).all())

    def fill(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, n_past: int) -> None:
        super().fill(keys, values, positions, n_past)
        self.ordered = True

    def reset(self) -> None:
        super().reset()
        self.ordered = True

    def _visible(self, first: int) -> tuple[torch.Tensor, int]:
        """Slots of the cells at positions >= ``first``, in increasing position order, and their count."""
        pos = self.positions[: self.n_used]
        visible = pos >= first
        count = int(visible.sum())
        order = torch.argsort(torch.where(visible, pos, self.next_pos))  # the visible ones first
        return order[:count], count

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> None:
        """Keep the new cells (positions from ``start``) that later queries attend: in free slots, then over
        the oldest cells that none can see any more; record what is dropped."""
        n = key_states.shape[-2]
        alive_from = start + n - self.window + 1  # the next token's first visible position
        keep = torch.arange(start, start + n, device=self.device)
        keep_mask = (keep < self.n_keep) | (keep >= alive_from)
        self._lose(max(start, self.n_keep), min(start + n, alive_from) - 1)  # new cells no one will attend
        new = torch.nonzero(keep_mask).squeeze(1)
        free = self.capacity - self.n_used
        slots = torch.arange(self.n_used, self.n_used + min(free, len(new)), device=self.device)
        if len(new) > free:
            pos = self.positions[: self.n_used]
            dead = (pos >= self.n_keep) & (pos < alive_from)
            oldest = torch.argsort(torch.where(dead, pos, self.next_pos + n))[: len(new) - free]
            dropped = pos[oldest]
            self._lose(int(dropped.min()), int(dropped.max()))
            slots = torch.cat((slots, oldest))
            self.ordered = False
        for buf, states in ((self.keys, key_states), (self.values, value_states)):
            buf.index_copy_(-2, slots, states.index_select(-2, new).to(buf.dtype))
        self.positions.index_copy_(0, slots, keep[new])
        self.n_used = min(self.capacity, self.n_used + len(new))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, Hkv, n, D) states at the next positions; return the cells the new queries may attend
        (a new tensor, increasing positions, the new ones last), tagged."""
        if key_states.device != self.device:
            self._move_to(key_states.device)
        n, start = key_states.shape[-2], self.next_pos
        first = max(0, start - self.window + 1)
        slots, count = self._visible(first)
        # the new states as the cache holds them (rounded to a bf16/f16 cache's type), as a full layer returns
        new_k, new_v = (
            key_states.to(self.dtype).to(key_states.dtype),
            value_states.to(self.dtype).to(value_states.dtype),
        )
        keys = torch.cat((self.keys.index_select(-2, slots).to(key_states.dtype), new_k), dim=-2)
        values = torch.cat((self.values.index_select(-2, slots).to(value_states.dtype), new_v), dim=-2)
        new = torch.arange(start, start + n, device=self.device)
        positions = torch.cat((self.positions.index_select(0, slots), new))
        cells = KeyCells(positions, first if count == start - first else None)
        self._store(key_states, value_states, start)
        self.next_pos = start + n
        return tag_cells(keys, cells), values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of what :meth:`update` returns for ``query_length`` new states."""
        first = max(0, self.next_pos - self.window + 1)
        return self.next_pos + query_length - first, first

    def get_max_length(self) -> int:
        return self.window

    def compact(self) -> None:
        """Drop the cells no later query can attend (positions from ``n_keep`` up to ``next_pos - window``)
        and pack the rest, in position order, at the front: free slots for in-place writes (the compiled
        decode step writes one cell per token at slot ``n_used``)."""
        pos = self.positions[: self.n_used]
        alive = (pos < self.n_keep) | (pos > self.next_pos - self.window)
        dead = pos[~alive]
        if len(dead):
            self._lose(int(dead.min()), int(dead.max()))
        slots = torch.nonzero(alive).squeeze(1)
        self._pack(0, slots[torch.argsort(pos[slots])])
        self.ordered = True
