"""One layer's cells of a :class:`~selfextend.kv.cache.ContextShiftCache`: keys and values with the position
of each, as llama.cpp's KV cells carry theirs.

The storage contract, which compiled decode steps read directly:

- ``keys``, ``values`` (B, Hkv, capacity, D) and ``positions`` (capacity,) int64 on one device, allocated
  once; the ``n_used`` cells in use are slots ``[0, n_used)``.
- A full-attention layer (:class:`ContextShiftLayer`) keeps them in increasing position order; a sliding layer
  (:class:`~selfextend.kv.sliding.SlidingShiftLayer`) uses its slots as a ring, in any order.
- Cell ``j`` is visible to a query at position ``p`` where it is in use, ``positions[j] <= p``, and for a
  sliding layer ``p - positions[j] < window``: consumers mask by position, never by slot.
- Moving cells (:meth:`CellLayer.remove`, :meth:`CellLayer.move`) is written once, here, for both kinds: keys
  are re-rotated by the position change in float32 with the layer's own frequencies; values never are.

``update`` (transformers' entry point) returns the cells the new queries may attend in increasing position
order, the new ones last, with their positions attached (:func:`~selfextend.core.cells.tag_cells`), so that
transformers' own attention functions, which mask by slot, see the layout they expect.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers.cache_utils import CacheLayerMixin

from selfextend.core.cells import KeyCells, tag_cells
from selfextend.core.decode_query import grouped_count
from selfextend.core.rope import RotationTable, rotate
from selfextend.core.validate import ValidationError
from selfextend.kv.grouped import GroupedKeys

NOTHING = (0, -1)
"""An empty inclusive range of positions."""


def _overlaps(lo: int, hi: int, a: int, b: int) -> bool:
    """Whether inclusive ``[lo, hi]`` meets half-open ``[a, b)``."""
    return lo <= hi and lo < b and a <= hi


class CellLayer(CacheLayerMixin):
    """What full and sliding layers share: the cells, their positions, and moving them.

    ``lost`` bounds (inclusive) the positions whose cells a sliding layer has overwritten: the positions
    before ``next_pos`` it may lack. ``next_pos`` is the position of the next token, the same in every
    layer of a cache.
    """

    is_compileable = False
    is_sliding = False
    window: int | None = None

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, n_keep: int = 0) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.positions = torch.zeros(keys.shape[-2], dtype=torch.long, device=keys.device)
        self._host, self._host_at = None, None  # a NumPy view of positions on the CPU (_set_position)
        self.dtype, self.device = keys.dtype, keys.device
        self.n_keep = n_keep
        self.n_used = 0
        self.next_pos = 0
        self.lost = NOTHING
        self.grouped = GroupedKeys()
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the buffers exist from the start."""

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]

    def _move_to(self, device: torch.device) -> None:
        """Put the buffers on ``device``, keeping what is cached (fresh buffers when empty: the first
        allocation may sit on the meta device of an offloaded model)."""
        if self.n_used == 0:
            self.keys = torch.zeros_like(self.keys, device=device)
            self.values = torch.zeros_like(self.values, device=device)
            self.positions = torch.zeros_like(self.positions, device=device)
        else:
            self.keys, self.values = self.keys.to(device), self.values.to(device)
            self.positions = self.positions.to(device)
        self.device = device

    def _lose(self, lo: int, hi: int) -> None:
        """Record that the cells of positions ``[lo, hi]`` (inclusive) may be gone."""
        was_lo, was_hi = self.lost
        if lo <= hi:
            self.lost = (lo, hi) if was_lo > was_hi else (min(lo, was_lo), max(hi, was_hi))

    def _pack(self, first: int, slots: torch.Tensor) -> None:
        """Copy the cells of ``slots`` (in that order) to ``first, first + 1, ...``; the rest go unused."""
        for t in (self.keys, self.values):
            t[..., first : first + len(slots), :] = t.index_select(-2, slots)
        self.positions[first : first + len(slots)] = self.positions.index_select(0, slots)
        self.n_used = first + len(slots)
        self.grouped.invalidate(first)

    def remove(self, p0: int, p1: int) -> None:
        """Drop the cells at positions ``[p0, p1)``; the others keep their order."""
        gone = (self.positions[: self.n_used] >= p0) & (self.positions[: self.n_used] < p1)
        hits = torch.nonzero(gone).squeeze(1)
        if len(hits):
            first = int(hits[0])
            self._pack(first, first + torch.nonzero(~gone[first:]).squeeze(1))
        self._removed(p0, p1)
        self._recheck()

    def _removed(self, p0: int, p1: int) -> None:
        """The positions ``[p0, p1)`` removed: no longer among those that may be lost."""
        lo, hi = self.lost
        if p0 <= lo and hi < p1:  # every lost position is removed too (or nothing was lost)
            self.lost = NOTHING
        elif lo < p0 <= hi < p1:
            self.lost = (lo, p0 - 1)
        elif p0 <= lo < p1 <= hi:
            self.lost = (p1, hi)

    def collides(self, p0: int, p1: int, delta: int) -> bool:
        """Whether :meth:`move` would give two cells one position."""
        pos = self.positions[: self.n_used]
        moved = (pos >= p0) & (pos < p1)
        new = torch.where(moved, pos + delta, pos)
        return bool((new < 0).any()) or len(torch.unique(new)) < len(new)

    def move(self, p0: int, p1: int, delta: int, inv_freq: torch.Tensor) -> None:
        """Add ``delta`` to the positions in ``[p0, p1)`` and re-rotate those keys by ``delta`` (K-shift: in
        float32, with this layer's ``inv_freq``, a pure rotation without ``attention_scaling``)."""
        pos = self.positions[: self.n_used]
        slots = torch.nonzero((pos >= p0) & (pos < p1)).squeeze(1)
        if len(slots):
            shift = torch.full((len(slots),), delta, device=self.device)
            self.keys[..., slots, :] = rotate(self.keys[..., slots, :], shift, inv_freq)
            self.positions[slots] += delta
            self.grouped.invalidate(int(slots[0]))
            self._order()
        lo, hi = self.lost
        parts = [(lo, min(hi, p0 - 1)), (max(lo, p0) + delta, min(hi, p1 - 1) + delta), (max(lo, p1), hi)]
        parts = [(a, b) for a, b in parts if a <= b]  # below, inside (moved) and above [p0, p1)
        self.lost = (min(a for a, _ in parts), max(b for _, b in parts)) if parts else NOTHING
        self._recheck()

    def _order(self) -> None:
        """Restore this kind's slot order after a move (a full layer's increasing positions)."""

    def _recheck(self) -> None:
        """Recompute what this kind derives from the positions and ``next_pos`` (a full layer's
        ``gapless``): called after every edit other than appending cells at ``next_pos``."""

    def follow(self, next_pos: int) -> None:
        """Set the position of the next token (the cache's, after an edit of any layer)."""
        self.next_pos = next_pos
        self._recheck()

    def claim(self, n: int = 1) -> int:
        """Record ``n`` new cells at the next positions in slots ``[start, start + n)`` and return ``start``:
        their keys and values are the caller's to write there before the cells are read (a full layer's
        :meth:`update` does; the decode step writes a token's cell itself, rotated and rounded in one pass).
        Slots stay in position order where they were."""
        start = self._free(n)
        end = start + n
        if end > self.capacity:
            raise ValidationError(
                "the context-shift cache",
                f"is full: {start} cells + {n} new > {self.capacity}; call make_room({n}) first "
                "(transformers' generate() cannot: selfextend.generation.generator.run shifts it)",
            )
        if n == 1:  # a decode step, one write per layer
            self._set_position(start, self.next_pos)
        else:
            self.positions[start:end] = torch.arange(self.next_pos, self.next_pos + n, device=self.device)
        self.grouped.invalidate(start)
        self.n_used, self.next_pos = end, self.next_pos + n
        return start

    def _set_position(self, slot: int, pos: int) -> None:
        """``positions[slot] = pos``; on the CPU through a NumPy view of the same memory, kept while
        ``positions`` is at the same address (a copied layer's is not): a torch item write costs ~6 us here,
        a NumPy one ~0.3."""
        at = self.positions.data_ptr()  # the view holds its tensor: no other tensor gets this address
        if self._host_at != at:
            self._host = self.positions.numpy() if self.positions.device.type == "cpu" else None
            self._host_at = at
        if self._host is None:
            self.positions[slot] = pos
        else:
            self._host[slot] = pos

    @property
    def first_position(self) -> int | None:
        """The position of slot 0 where slot ``s`` holds position ``first_position + s`` (a gapless full
        layer), else None."""
        return None

    def grouped_now(
        self, pos: int, group_size: int, window: int, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor | None, int] | None:
        """What a decode query at ``pos`` over every cell scores at Self-Extend's grouped positions (window
        ``window``), where it is known at once: ``(buffer, n_g)``, ``n_g`` keys held current in
        :attr:`grouped`'s buffer (B, Hkv, capacity, D), or ``(None, 0)`` for none; None where finding them
        takes :func:`~selfextend.core.decode_query.grouped_decode_keys` (a gap, keys to rotate). A decode
        step asks per layer: integer arithmetic and attribute reads, where that is a dozen torch calls."""
        start = self.first_position
        if start is None:
            return None
        n_g = grouped_count(pos, window, self.n_used, start, self.positions)
        if n_g == 0:
            return None, 0
        buffer = self.grouped.held(self.keys, n_g, group_size, inv_freq)
        return None if buffer is None else (buffer, n_g)

    def _free(self, n: int) -> int:
        """The first of ``n`` free slots after the cells in use (a sliding layer makes room first)."""
        return self.n_used

    def reserve(self, n: int) -> None:
        """Make room now for ``n`` cells at the next positions, claimed one by one after this (a decode step's
        rows of one sequence): a sliding layer compacts here, while every cell those rows and a cut back to
        any of them attend is still held, not at a row's claim, where the cells of the rows before it would
        be moved under their queries and dropped while they still attend them."""
        self._free(n)

    def visible_from(self, pos: int, window: int | None) -> int:
        """The first slot a query at ``pos`` attends through a sliding ``window`` (None: every cell), for
        cells in position order (a full layer's; a sliding layer's after :meth:`claim`): cells at positions
        above ``pos - window`` are the last ones."""
        if window is None:
            return 0
        return int(torch.searchsorted(self.positions[: self.n_used], pos - window, right=True))

    def max_position(self) -> int:
        """The highest position held, -1 when empty."""
        return int(self.positions[: self.n_used].max()) if self.n_used else -1

    def needed(self, n_past: int) -> int:
        """How many positions the tokens after ``n_past`` cached ones attend, now or after shifts: all of
        them, or for a sliding layer the kept ones and the window."""
        if self.window is None:
            return n_past
        kept = min(n_past, self.n_keep)
        return kept + max(0, n_past - max(self.n_keep, n_past - self.window + 1))

    def is_needed(self, positions: torch.Tensor, n_past: int) -> torch.Tensor:
        """Which of ``positions`` (all below ``n_past``) are among :meth:`needed`'s."""
        if self.window is None:
            return torch.ones_like(positions, dtype=torch.bool)
        return (positions < self.n_keep) | (positions >= n_past - self.window + 1)

    def holds(self, n_past: int) -> bool:
        """Whether, cut back to ``n_past`` tokens, this layer would still hold every cell the next tokens
        attend (a sliding layer may have overwritten some)."""
        lo, hi = self.lost[0], min(self.lost[1], n_past - 1)
        if lo > hi or self.window is None:
            return True
        return not (
            _overlaps(lo, hi, 0, min(n_past, self.n_keep))
            or _overlaps(lo, hi, max(self.n_keep, n_past - self.window + 1), n_past)
        )

    def fill(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, n_past: int) -> None:
        """Replace the contents by cells (B, Hkv, n, D) at ``positions`` (n,), increasing, below n_past."""
        n = keys.shape[-2]
        self.keys[..., :n, :] = keys.to(self.device, self.dtype)
        self.values[..., :n, :] = values.to(self.device, self.dtype)
        self.positions[:n] = positions.to(self.device)
        self.n_used, self.next_pos, self.lost = n, n_past, NOTHING
        self.grouped.invalidate(0)
        missing = torch.ones(n_past, dtype=torch.bool, device=self.device)
        missing[self.positions[:n]] = False
        gaps = torch.nonzero(missing).squeeze(1)
        if len(gaps):
            self._lose(int(gaps[0]), int(gaps[-1]))
        self._recheck()

    def truncate(self, n_past: int) -> None:
        """Forget every cell from position ``n_past`` on."""
        if n_past < self.next_pos:
            self.remove(n_past, self.next_pos)
            self.follow(n_past)

    def get_seq_length(self) -> int:
        return self.next_pos

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.n_used, self.next_pos, self.lost = 0, 0, NOTHING
        self.grouped.invalidate(0)
        self._recheck()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (transformers' convention: a negative count)."""
        self.truncate(max(0, self.next_pos + min(tokens_to_remove, 0)))


class ContextShiftLayer(CellLayer):
    """A full-attention layer: every cell, in increasing position order, in (B, Hkv, n_ctx, D) buffers.

    ``gapless``: the cells' positions are ``next_pos - n_used, ..., next_pos - 1``, every position up to the
    next token's since the first cell (then slot ``s`` is at ``next_pos - n_used + s``, read without the
    positions). Every edit rechecks it against ``next_pos``; appending cells at ``next_pos`` (:meth:`claim`,
    the compiled step's commit) keeps it, and makes it true for an empty layer.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__(keys, values)
        self.gapless = True

    def _order(self) -> None:
        pos = self.positions[: self.n_used]
        if self.n_used > 1 and not bool((pos[1:] > pos[:-1]).all()):
            self._pack(0, torch.argsort(pos))

    def truncate(self, n_past: int) -> None:
        """Forget every cell from position ``n_past`` on: where the cells are gapless, the last ones, dropped
        without a search of the positions (a speculative check's refused drafts, every layer at every check:
        ~60 us a layer the search's way)."""
        first = self.first_position
        if first is None or not first <= n_past < self.next_pos:
            super().truncate(n_past)
            return
        self.n_used -= self.next_pos - n_past  # the rest stay gapless, up to the new next position
        self.grouped.invalidate(self.n_used)
        self._removed(n_past, self.next_pos)
        self.next_pos = n_past

    def _recheck(self) -> None:
        pos = self.positions[: self.n_used]
        self.gapless = self.n_used == 0 or (
            int(pos[-1]) == self.next_pos - 1 and int(pos[-1] - pos[0]) == self.n_used - 1
        )

    @property
    def first_position(self) -> int | None:
        return self.next_pos - self.n_used if self.gapless else None

    def claim(self, n: int = 1) -> int:
        start = super().claim(n)
        self.gapless = self.gapless or start == 0  # cells appended at next_pos: a gap stays; none if empty
        return start

    def _grouped(
        self,
        group_size: int,
        inv_freq: torch.Tensor,
        n: int,
        rotations: RotationTable | None,
        ready: int | None = None,
    ) -> torch.Tensor:
        first = self.next_pos - self.n_used if self.gapless else None
        ready = self.n_used if ready is None else ready
        return self.grouped.get(self.keys, self.positions, group_size, inv_freq, n, rotations, first, ready)

    def cells(self, end: int, ready: int | None = None) -> KeyCells:
        """The :class:`KeyCells` of slots [0, end) (the gapless case when the cells are); ``ready``: slots
        ``[0, ready)`` hold written keys (default: every claimed one; a decode step that claims several rows'
        cells before it writes them says fewer)."""
        first = self.next_pos - self.n_used if self.gapless else None
        grouped = self._grouped if ready is None else partial(self._grouped, ready=ready)
        return KeyCells(self.positions[:end], first, grouped)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, Hkv, n, D) states at the next positions; return every cell (views), tagged."""
        if key_states.device != self.device:  # a layer placed on another device by a device map
            self._move_to(key_states.device)
        n = key_states.shape[-2]
        start = self.claim(n)
        end = start + n
        self.keys[..., start:end, :] = key_states
        self.values[..., start:end, :] = value_states
        # a reduced-precision cache (--cache-type) hands the attention its states in the model's dtype
        keys = self.keys[..., :end, :].to(key_states.dtype)
        return tag_cells(keys, self.cells(end)), self.values[..., :end, :].to(value_states.dtype)

    def visible_from(self, pos: int, window: int | None) -> int:
        if window is None or not self.gapless:
            return super().visible_from(pos, window)
        return max(0, pos - window + 1 - (self.next_pos - self.n_used))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): every cell and the new ones, the last at the last query's position."""
        return self.n_used + query_length, self.next_pos - self.n_used
