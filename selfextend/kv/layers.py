"""One layer's cells of a :class:`~selfextend.kv.cache.ContextShiftCache`: all of them (full attention), or
the kept ones and the window (sliding attention).

Storage is allocated once at construction and never reallocated; a shift drops cells, moves the survivors
down and re-rotates their keys (:func:`~selfextend.core.rope.rotate`, in float32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import CacheLayerMixin

from selfextend.core.rope import rotate

Range = tuple[int, int]
"""Positions ``[lo, hi)``."""


def merge(ranges: Sequence[Range]) -> list[Range]:
    """Position ranges in increasing order without the empty ones, touching ones joined."""
    out: list[Range] = []
    for lo, hi in ranges:
        if hi <= lo:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def covers(held: Sequence[Range], needed: Sequence[Range]) -> bool:
    """Whether every needed range lies inside one held range."""
    return all(any(a <= lo and hi <= b for a, b in held) for lo, hi in needed)


def gather(held: Sequence[Range], states: torch.Tensor, needed: Sequence[Range]) -> torch.Tensor:
    """The cells of the ``needed`` positions, in order, from (B, Hkv, n, D) ``states`` that hold the
    ``held`` positions one cell each, in order. ``needed`` must be covered (:func:`covers`)."""
    starts, slot = [], 0  # (lo, hi, first slot) of each held range
    for a, b in held:
        starts.append((a, b, slot))
        slot += b - a
    parts = []
    for lo, hi in needed:
        a, _, s = next(r for r in starts if r[0] <= lo and hi <= r[1])
        parts.append(states[..., s + lo - a : s + hi - a, :])
    if not parts:
        return states[..., :0, :]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


class ContextShiftLayer(CacheLayerMixin):
    """One layer's keys and values in preallocated (B, Hkv, n_ctx, D) buffers, filled up to ``n_past``."""

    is_sliding = False
    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.n_past = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the buffers exist from the start."""

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, Hkv, n, D) states and return views of all cached states; never truncates."""
        if key_states.device != self.device:  # a layer placed on another device by a device map
            self._move(key_states.device)
        n = key_states.shape[-2]
        end = self.n_past + n
        if end > self.capacity:
            raise RuntimeError(
                f"KV cache overflow: {self.n_past} cached + {n} new > {self.capacity}; call make_room() first"
            )
        self.keys[..., self.n_past : end, :] = key_states
        self.values[..., self.n_past : end, :] = value_states
        self.n_past = end
        # a reduced-precision cache (--cache-type) hands the attention states in the model's dtype
        return self.keys[..., :end, :].to(key_states.dtype), self.values[..., :end, :].to(value_states.dtype)

    def _move(self, device: torch.device) -> None:
        """Put the buffers on ``device``, keeping what is cached (fresh buffers when empty: the first
        allocation may sit on the meta device of an offloaded model)."""
        if self.n_past == 0:
            self.keys = torch.zeros_like(self.keys, device=device)
            self.values = torch.zeros_like(self.values, device=device)
        else:
            self.keys, self.values = self.keys.to(device), self.values.to(device)
        self.device = device

    def shift(self, n_keep: int, n_discard: int, inv_freq: torch.Tensor) -> None:
        """Drop cells [n_keep, n_keep + n_discard) and move the rest down, keys re-rotated by -n_discard."""
        src, dst = slice(n_keep + n_discard, self.n_past), slice(n_keep, self.n_past - n_discard)
        moved = self.n_past - n_keep - n_discard
        delta = torch.full((moved,), -n_discard, device=self.device)
        self.keys[..., dst, :] = rotate(self.keys[..., src, :], delta, inv_freq)
        self.values[..., dst, :] = self.values[..., src, :].clone()
        self.n_past -= n_discard

    def held(self) -> list[Range]:
        """The positions whose cells this layer holds, in the order of :meth:`states`."""
        return merge([(0, self.n_past)])

    def needs(self, n_past: int) -> list[Range]:
        """The positions whose cells the next tokens attend after ``n_past`` cached ones."""
        return merge([(0, n_past)])

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the held keys and values, (B, Hkv, n, D) each."""
        return self.keys[..., : self.n_past, :], self.values[..., : self.n_past, :]

    def place(self, n_past: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the contents by the cells of ``needs(n_past)``, in order, (B, Hkv, n, D) each."""
        self.reset()
        self.update(keys.to(self.device, self.dtype), values.to(self.device, self.dtype))

    def truncate(self, n_past: int) -> None:
        """Forget every cell from ``n_past`` on."""
        self.n_past = min(self.n_past, n_past)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_past + query_length, 0

    def get_seq_length(self) -> int:
        return self.n_past

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.n_past = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` cells (transformers' convention: a negative count)."""
        self.truncate(max(0, self.n_past + min(tokens_to_remove, 0)))


class SlidingShiftLayer(ContextShiftLayer):
    """A sliding-window layer's cells: positions ``[0, n_keep)`` in slots ``[0, n_keep)`` and the tail
    ``[start, n_past)`` from slot ``n_keep`` on, at least the last ``window - 1`` positions.

    A query at position ``p`` attends positions ``p - window + 1 .. p``, so once ``start > n_keep`` the kept
    cells are out of every query's window until a shift brings them back (``start`` then returns to
    ``n_keep``). :meth:`update` returns keys contiguous in position that end at the last query: all from
    position 0 while kept cells and tail touch, else the tail only; :meth:`get_mask_sizes` says which (the
    offset of the first key), as transformers' ``DynamicSlidingWindowLayer`` does. A write larger than the
    free slots (a prefill chunk) returns old and new cells as a temporary and stores the last ``window - 1``.
    """

    is_sliding = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, window: int, n_keep: int) -> None:
        super().__init__(keys, values)
        self.window, self.n_keep = window, n_keep
        self.start = (
            n_keep  # position of the cell in slot n_keep (while n_past <= n_keep: the next one there)
        )
        self.used = 0  # slots in use: min(n_past, n_keep) + (n_past - start if n_past > start else 0)

    def _plan(self, n: int) -> tuple[int, int]:
        """(start, used) once room is made for a write of ``n``: unchanged if it fits in the free slots, else
        without the tail cells that no query of the write can see (before ``n_past - window + 1``)."""
        if self.used + n <= self.capacity:
            return self.start, self.used
        start = max(self.start, self.n_past - self.window + 1)
        return start, self.used - (start - self.start)

    def _first(self, start: int) -> tuple[int, int]:
        """(slot, position) of the first cell :meth:`update` returns: 0 while kept cells and tail touch."""
        return (0, 0) if start == self.n_keep else (self.n_keep, start)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys the next :meth:`update` of ``query_length`` states returns."""
        start, used = self._plan(query_length)
        slot, position = self._first(start)
        return used - slot + query_length, position

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, Hkv, n, D) states; return the cells the queries can attend, contiguous in position."""
        if key_states.device != self.device:
            self._move(key_states.device)
        n = key_states.shape[-2]
        start, used = self._plan(n)
        if start != self.start:  # move the cells still visible to the front of the tail
            src = slice(self.n_keep + start - self.start, self.used)
            self.keys[..., self.n_keep : used, :] = self.keys[..., src, :].clone()
            self.values[..., self.n_keep : used, :] = self.values[..., src, :].clone()
            self.start, self.used = start, used
        slot, position = self._first(self.start)
        end = self.used + n
        if end <= self.capacity:
            self.keys[..., self.used : end, :] = key_states
            self.values[..., self.used : end, :] = value_states
            self.used, self.n_past = end, self.n_past + n
            return self.keys[..., slot:end, :].to(key_states.dtype), self.values[..., slot:end, :].to(
                value_states.dtype
            )
        keys = torch.cat((self.keys[..., slot : self.used, :].to(key_states.dtype), key_states), dim=-2)
        values = torch.cat(
            (self.values[..., slot : self.used, :].to(value_states.dtype), value_states), dim=-2
        )
        n_past = self.n_past + n
        kept = min(n_past, self.n_keep)
        if position == 0:  # the write may reach into the kept cells
            self.keys[..., :kept, :], self.values[..., :kept, :] = keys[..., :kept, :], values[..., :kept, :]
        tail = max(self.n_keep, n_past - self.window + 1)
        self.keys[..., kept : kept + n_past - tail, :] = keys[..., tail - position :, :]
        self.values[..., kept : kept + n_past - tail, :] = values[..., tail - position :, :]
        self.n_past, self.start, self.used = n_past, tail, kept + max(0, n_past - tail)
        return keys, values

    def shift(self, n_keep: int, n_discard: int, inv_freq: torch.Tensor) -> None:
        """Drop positions [n_keep, n_keep + n_discard) from the tail and move the rest to its front, keys
        re-rotated by -n_discard (the kept cells stay)."""
        first = max(self.start, n_keep + n_discard)  # first surviving position
        src = slice(n_keep + first - self.start, self.used)
        moved = self.used - src.start
        dst = slice(n_keep, n_keep + moved)
        delta = torch.full((moved,), -n_discard, device=self.device)
        self.keys[..., dst, :] = rotate(self.keys[..., src, :], delta, inv_freq)
        self.values[..., dst, :] = self.values[..., src, :].clone()
        self.n_past -= n_discard
        self.start, self.used = first - n_discard, n_keep + moved

    def held(self) -> list[Range]:
        return merge([(0, min(self.n_past, self.n_keep)), (self.start, self.n_past)])

    def needs(self, n_past: int) -> list[Range]:
        return merge([(0, min(n_past, self.n_keep)), (max(self.n_keep, n_past - self.window + 1), n_past)])

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[..., : self.used, :], self.values[..., : self.used, :]

    def place(self, n_past: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[-2]
        self.keys[..., :n, :] = keys.to(self.device, self.dtype)
        self.values[..., :n, :] = values.to(self.device, self.dtype)
        self.n_past, self.used = n_past, n
        self.start = max(self.n_keep, n_past - self.window + 1)

    def truncate(self, n_past: int) -> None:
        """Forget every cell from ``n_past`` on; refuses (ValueError) where the tokens before ``n_past``
        attend cells this layer has already dropped."""
        if n_past >= self.n_past:
            return
        if not covers(self.held(), self.needs(n_past)):
            raise ValueError(
                f"a sliding layer cannot go back to {n_past} cells: it holds positions {self.held()} "
                f"and the next token attends {self.needs(n_past)}"
            )
        self.n_past = n_past
        if n_past <= self.n_keep:
            self.start, self.used = self.n_keep, n_past
        else:
            self.used = self.n_keep + n_past - self.start

    def get_max_length(self) -> int:
        return self.window

    def reset(self) -> None:
        self.n_past, self.start, self.used = 0, self.n_keep, 0
