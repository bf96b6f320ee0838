"""A fixed-size KV cache that shifts its context instead of growing: generation runs forever.

As llama.cpp does when ``n_past + n_new > n_ctx``: keep the first ``n_keep`` cells (the system
prompt), discard the older half of the rest, ``n_discard = (n_past - n_keep) // 2``, move the
newer half down by ``n_discard`` and re-rotate its keys by ``-n_discard`` (K-shift: keys are
cached after RoPE, and rotations compose), each layer with its own rotary frequencies. Values are
not rotated. Positions stay contiguous, so after a shift the next token is exactly what a fresh
forward over the kept tokens at their compacted positions would give, and Self-Extend's grouped
positions follow the shifted ones.

A sliding-window layer of a hybrid model (Gemma 3: 15 of 18 layers attend the last 512 tokens)
holds only what a query can still attend: the kept cells, which come back inside the window after
a shift, and the last ``window - 1`` cells (:class:`SlidingShiftLayer`). The storage is allocated
once per layer at construction and never reallocated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from selfextend.models import kv_shape
from selfextend.patch import layer_kinds
from selfextend.rope import layer_frequencies, rotate
from selfextend.validate import check_int

Range = tuple[int, int]
"""Positions ``[lo, hi)``."""


def discard_count(n_past: int, n_keep: int) -> int:
    """Cells one context shift drops: the older half of what is not kept (llama.cpp's rule)."""
    return (n_past - n_keep) // 2


DiscardPolicy = Callable[[int, int, int], int]
"""``(n_past, n_keep, n_need) -> n_discard``: how many cells after the kept ones the next shift drops,
given that at least ``n_need`` must go for the pending write to fit (fewer means another shift follows).
The cache shifts by exactly the returned count right after the call."""


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


def sliding_windows(config: Any) -> list[int | None]:
    """Each decoder layer's attention window (``config.sliding_window``) for its sliding layers, None for
    the full-attention ones (of a model or its config)."""
    window = getattr(getattr(config, "config", config).get_text_config(), "sliding_window", None)
    return [
        int(window) if kind == "sliding_attention" and isinstance(window, int) else None
        for kind in layer_kinds(config)
    ]


def sliding_cells(window: int, n_keep: int) -> int:
    """Cells a sliding layer allocates: the kept ones and ``2 * (window - 1)`` for the rest, so that decoding
    writes in place for ``window - 1`` steps between two moves of the last ``window - 1`` cells to the front
    (one cell copied per step on average, instead of the whole window at each step)."""
    return n_keep + 2 * (window - 1)


def layer_cells(config: Any, n_ctx: int, n_keep: int = 0, sliding: bool = True) -> list[int]:
    """Cells each layer of a :class:`ContextShiftCache` of ``n_ctx`` keeping ``n_keep`` allocates: ``n_ctx``,
    or less for a sliding layer (:func:`sliding_cells`) where that is smaller. ``sliding=False``: every
    layer ``n_ctx`` (the layout before sliding layers were bounded)."""
    return [
        n_ctx if w is None or not sliding else min(n_ctx, sliding_cells(w, n_keep))
        for w in sliding_windows(config)
    ]


def cache_bytes(
    config: Any, n_ctx: int, n_keep: int = 0, bytes_per_value: int = 2, sliding: bool = True
) -> int:
    """Bytes of a :class:`ContextShiftCache`'s buffers (K and V, batch 1) for a model's config."""
    kv_heads, head_dim = kv_shape(config)
    return 2 * bytes_per_value * kv_heads * head_dim * sum(layer_cells(config, n_ctx, n_keep, sliding))


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
        return self.keys[..., :end, :], self.values[..., :end, :]

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
            return self.keys[..., slot:end, :], self.values[..., slot:end, :]
        keys = torch.cat((self.keys[..., slot : self.used, :], key_states), dim=-2)  # from `position` on
        values = torch.cat((self.values[..., slot : self.used, :], value_states), dim=-2)
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


class ContextShiftCache(Cache):
    """A transformers ``Cache`` of fixed capacity ``n_ctx`` that keeps ``n_keep`` tokens and shifts the rest.

    Call :meth:`make_room` before each forward with the number of tokens about to be written;
    it shifts as often as needed and returns how many shifts it made. Positions for the next
    tokens are ``get_seq_length()`` onwards, which transformers uses by default. Sliding-window
    layers hold only their window and the kept cells (``sliding=False``: all ``n_ctx`` cells, as
    full layers do; for comparisons).
    """

    def __init__(
        self,
        model: nn.Module,
        n_ctx: int,
        n_keep: int = 0,
        batch_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        sliding: bool = True,
    ) -> None:
        n_ctx = check_int(n_ctx, "context size", 2)
        n_keep = check_int(n_keep, "n_keep (tokens kept at every shift)", 0, n_ctx - 2)
        batch_size = check_int(batch_size, "batch size", 1)
        config = model.config.get_text_config()
        kv_heads, head_dim = kv_shape(config)
        param = next(model.parameters())
        dtype, device = dtype or param.dtype, device or param.device
        layers: list[ContextShiftLayer] = []
        windows = sliding_windows(config)
        for cells, window in zip(layer_cells(config, n_ctx, n_keep, sliding), windows, strict=True):
            shape = (batch_size, kv_heads, cells, head_dim)
            k, v = (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            layers.append(
                ContextShiftLayer(k, v) if cells == n_ctx else SlidingShiftLayer(k, v, window, n_keep)
            )
        super().__init__(layers=layers)
        self.frequencies = layer_frequencies(model)  # each layer's own (Gemma 3: local and global bases)
        self.n_ctx, self.n_keep = n_ctx, n_keep
        self.shifts = 0
        self.discarded = 0
        self.discard_policy: DiscardPolicy | None = None  # None: discard_count (llama.cpp's half)

    @property
    def n_past(self) -> int:
        return self.layers[0].n_past

    def nbytes(self) -> int:
        """Bytes of the allocated key and value buffers."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))

    def free(self) -> int:
        """Cells left before the next shift."""
        return self.n_ctx - self.n_past

    def max_chunk(self) -> int:
        """The largest write that one shift can always make room for (half of the shiftable part)."""
        return max(1, (self.n_ctx - self.n_keep) // 2)

    def can_truncate(self, n_past: int) -> bool:
        """Whether :meth:`truncate` to ``n_past`` is exact: no sliding layer has dropped a cell the tokens
        before ``n_past`` attend (always true back to ``n_keep``)."""
        n_past = min(n_past, self.n_past)
        return all(covers(layer.held(), layer.needs(n_past)) for layer in self.layers)

    def truncate(self, n_past: int) -> None:
        """Forget every cell from ``n_past`` on (no shift, no rotation); ValueError, with nothing changed,
        unless :meth:`can_truncate` (see :meth:`selfextend.generate.Generator.rewind` for what to do then)."""
        if not self.can_truncate(n_past):
            raise ValueError(
                f"cannot go back to {n_past} of {self.n_past} cells exactly: the sliding layers have dropped "
                "cells the last of those tokens attend; recompute them from the tokens instead"
            )
        for layer in self.layers:
            layer.truncate(n_past)

    def loadable(self, held: Sequence[Sequence[Range]], n_past: int) -> int:
        """The longest prefix, at most ``n_past``, that :meth:`load_prefix` can load from states that hold
        positions ``held[i]`` for layer ``i``: each layer must find every cell it needs."""
        ends = {n_past, min(n_past, self.n_keep), 0} | {hi for h in held for _, hi in h if hi < n_past}
        for n in sorted(ends, reverse=True):
            if all(covers(h, layer.needs(n)) for layer, h in zip(self.layers, held, strict=True)):
                return n
        return 0

    def load_prefix(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        n_past: int | None = None,
        held: Sequence[Sequence[Range]] | None = None,
    ) -> None:
        """Fill the cache with per-layer (B, Hkv, n, D) states (from a prompt-cache file): the cells of the
        positions ``held[i]`` for layer ``i`` (default: ``[0, n)``), of which the first ``n_past`` positions
        are loaded (default: all). ValueError if a layer lacks a cell it needs."""
        if len(keys) != len(self.layers):
            raise ValueError(f"{len(keys)} layers of states for a cache of {len(self.layers)} layers")
        held = held or [merge([(0, k.shape[-2])]) for k in keys]
        if n_past is None:
            n_past = max((h[-1][1] for h in held if h), default=0)
        for i, (layer, h) in enumerate(zip(self.layers, held, strict=True)):
            if not covers(h, layer.needs(n_past)):
                raise ValueError(
                    f"layer {i} holds positions {list(h)}, not the {layer.needs(n_past)} it needs"
                )
        for layer, h, k, v in zip(self.layers, held, keys, values, strict=True):
            needed = layer.needs(n_past)
            layer.place(n_past, gather(h, k, needed), gather(h, v, needed))

    def make_room(self, n_new: int) -> int:
        """Shift until ``n_new`` more tokens fit; returns the number of shifts made."""
        if n_new > self.n_ctx - self.n_keep - 1:
            raise ValueError(
                f"cannot write {n_new} tokens at once into a cache of {self.n_ctx} keeping {self.n_keep}; "
                f"feed at most {self.max_chunk()} at a time"
            )
        made = 0
        while self.n_past + n_new > self.n_ctx:
            if self.discard_policy is None:
                n_discard = discard_count(self.n_past, self.n_keep)
            else:
                n_discard = self.discard_policy(self.n_past, self.n_keep, self.n_past + n_new - self.n_ctx)
            self.shift(n_discard)
            made += 1
        return made

    def shift(self, n_discard: int) -> None:
        """One context shift: drop cells ``[n_keep, n_keep + n_discard)``, move the rest down and re-rotate
        their keys by ``-n_discard``."""
        if not 1 <= n_discard <= self.n_past - self.n_keep:
            raise ValueError(
                f"cannot discard {n_discard} cells: {self.n_past} cached, {self.n_keep} kept"
                if n_discard
                else f"nothing left to discard: {self.n_past} cached, {self.n_keep} kept"
            )
        for layer, freq in zip(self.layers, self.frequencies, strict=True):
            layer.shift(self.n_keep, n_discard, freq.inv_freq)
        self.shifts += 1
        self.discarded += n_discard
