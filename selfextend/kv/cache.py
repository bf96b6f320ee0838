"""A fixed-size KV cache that shifts its context instead of growing: generation runs forever.

As llama.cpp does when ``n_past + n_new > n_ctx``: keep the first ``n_keep`` cells (the system
prompt), discard the older half of the rest, ``n_discard = (n_past - n_keep) // 2``, move the
newer half down by ``n_discard`` and re-rotate its keys by ``-n_discard`` (K-shift: keys are
cached after RoPE, and rotations compose), each layer with its own rotary frequencies. Values are
not rotated. After a shift the next token is exactly what a fresh forward over the kept tokens at
their compacted positions would give, and Self-Extend's grouped positions follow the shifted ones.

Every cell carries its position (:mod:`selfextend.kv.layers`), so a shift is two operations named
after llama.cpp's memory API, which also move any other chunk of cells: :meth:`ContextShiftCache.remove`
and :meth:`ContextShiftCache.move`.

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
from transformers.cache_utils import Cache

from selfextend.core.rope import layer_frequencies
from selfextend.core.validate import ValidationError, check_int, first_line
from selfextend.hf.facts import check_rope, kv_shape, require_model, sliding_windows
from selfextend.hf.patch import check_reach
from selfextend.kv.layers import CellLayer, ContextShiftLayer
from selfextend.kv.sliding import SlidingShiftLayer
from selfextend.models.diskcache import parse_dtype


def discard_count(n_past: int, n_keep: int) -> int:
    """Cells one context shift drops: the older half of what is not kept (llama.cpp's rule)."""
    return (n_past - n_keep) // 2


SINKS = 4
"""Leading tokens a shift keeps by default where the prompt has no BOS and no system part: the first tokens
are where a model's attention rests (StreamingLLM's attention sinks, Xiao et al. 2023), and a cache that
drops them falls apart after its first shift (SmolLM2, which has no BOS: ``generate --no-chat --keep 0``
on an 806-token list in a 512-cell cache writes "The first of applications. further"; ``--keep 1`` or 4
goes on with the list)."""


def default_keep(n_system: int, n_prompt: int, n_ctx: int) -> int:
    """Cells every shift keeps unless told: the system part (BOS, system prompt; llama.cpp keeps the BOS),
    as it is (a cache of ``n_ctx`` cells refuses one that leaves no room), or where there is none the first
    :data:`SINKS` tokens of the prompt, never so many that the cache has no room left. ValidationError for
    a count that is not an integer >= 0."""
    n_system, n_prompt = check_int(n_system, "n_system", 0, None), check_int(n_prompt, "n_prompt", 0, None)
    n_ctx = check_int(n_ctx, "n_ctx", 0, None)  # (a prompt built for no cache in particular: 2^31)
    return n_system if n_system else max(0, min(SINKS, n_prompt, n_ctx - 2))


DiscardPolicy = Callable[[int, int, int], int]
"""``(n_past, n_keep, n_need) -> n_discard``: how many cells after the kept ones the next shift drops,
given that at least ``n_need`` must go for the pending write to fit (fewer means another shift follows).
The cache shifts by exactly the returned count right after the call."""


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


def _cell_dtype(dtype: Any) -> torch.dtype:
    """The cells' type: a floating torch dtype or a name (``bf16``, ``float16``...); else ValidationError."""
    try:
        parsed = parse_dtype(dtype)
    except ValueError:
        parsed = None
    if not isinstance(parsed, torch.dtype) or not parsed.is_floating_point:
        raise ValidationError("cache dtype", f"must be a floating type (float32, bfloat16...), got {dtype!r}")
    return parsed


def _device(device: Any) -> torch.device:
    """``device`` as a torch device; ValidationError for a name torch does not know."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValidationError("cache device", f"{device!r} is not a device: {first_line(exc)}") from None
    if device.type == "cuda" and not torch.cuda.is_available():  # torch's AssertionError otherwise
        raise ValidationError("cache device", f"{device} is not available here (no CUDA GPU torch can use)")
    return device


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
        require_model(model, "ContextShiftCache")
        check_rope(model.config)  # ModelError for GPT-2, OPT...: nothing here to re-rotate
        n_ctx = check_int(n_ctx, "context size", 2)
        n_keep = check_int(n_keep, "n_keep (tokens kept at every shift)", 0, n_ctx - 2)
        batch_size = check_int(batch_size, "batch size", 1)
        config = model.config.get_text_config()
        kv_heads, head_dim = kv_shape(config)
        param = next(model.parameters())
        dtype, device = _cell_dtype(dtype or param.dtype), _device(device or param.device)
        layers: list[CellLayer] = []
        windows = sliding_windows(config)
        try:
            for cells, window in zip(layer_cells(config, n_ctx, n_keep, sliding), windows, strict=True):
                shape = (batch_size, kv_heads, cells, head_dim)
                k, v = (
                    torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device),
                )
                layers.append(
                    ContextShiftLayer(k, v) if cells == n_ctx else SlidingShiftLayer(k, v, window, n_keep)
                )
        except (RuntimeError, MemoryError):  # torch's "can't allocate memory", CUDA's out of memory
            size = cache_bytes(config, n_ctx, n_keep, torch.empty((), dtype=dtype).element_size(), sliding)
            raise ValidationError(
                "context size",
                f"({n_ctx:,} cells) needs {size * batch_size / 2**30:,.2f} GiB of keys and values, more than "
                f"{device} could allocate",
            ) from None
        super().__init__(layers=layers)
        self.frequencies = layer_frequencies(model)  # each layer's own (Gemma 3: local and global bases)
        check_reach(model, n_ctx, "a cache of")
        self.n_ctx, self.n_keep = n_ctx, n_keep
        self.shifts = 0
        self.discarded = 0
        self.last_shift = (0, 0)  # (cells cached before it, cells it dropped): a draft model replays it
        self.discard_policy: DiscardPolicy | None = None  # None: discard_count (llama.cpp's half)

    @property
    def n_past(self) -> int:
        """The position of the next token (the number of tokens cached, unless cells were removed
        without moving the later ones down)."""
        return self.layers[0].next_pos

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
        after ``n_past`` attend (always true back to ``n_keep``). ``can_truncate(n_past)`` with the current
        ``n_past`` says whether the cache is exact after :meth:`remove` / :meth:`move`."""
        n_past = min(n_past, self.n_past)
        return all(layer.holds(n_past) for layer in self.layers)

    def truncate(self, n_past: int) -> None:
        """Forget every cell from ``n_past`` on (no shift, no rotation); ValueError, with nothing changed,
        unless :meth:`can_truncate` (see
        :meth:`selfextend.generation.generator.Generator.rewind` for what to do then)."""
        n_past = check_int(n_past, "n_past", 0)
        if not self.can_truncate(n_past):
            raise ValueError(
                f"cannot go back to {n_past} of {self.n_past} cells exactly: the sliding layers have dropped "
                "cells the last of those tokens attend; recompute them from the tokens instead"
            )
        for layer in self.layers:
            layer.truncate(n_past)

    def remove(self, p0: int, p1: int | None = None) -> None:
        """Drop the cells at positions ``[p0, p1)`` (``p1`` None: to the end) from every layer, as llama.cpp's
        ``llama_memory_seq_rm``; later cells keep their positions (see :meth:`move`)."""
        p0 = check_int(p0, "first position", 0)
        p1 = self.n_past if p1 is None else check_int(p1, "end position", p0)
        for layer in self.layers:
            layer.remove(p0, p1)
        self._follow()

    def move(self, p0: int, p1: int | None, delta: int) -> None:
        """Add ``delta`` to the positions in ``[p0, p1)`` (``p1`` None: to the end) and re-rotate those keys
        (K-shift), each layer with its own frequencies, as llama.cpp's ``llama_memory_seq_add``. ValueError,
        with nothing changed, where two cells would share a position or one would go below 0."""
        p0 = check_int(p0, "first position", 0)
        p1 = self.n_past if p1 is None else check_int(p1, "end position", p0)
        delta = check_int(delta, "position change")
        if delta == 0 or p1 == p0:
            return
        if any(layer.collides(p0, p1, delta) for layer in self.layers):
            raise ValueError(
                f"cannot move [{p0}, {p1}) by {delta}: two cells would share a position or one go below 0"
            )
        for layer, freq in zip(self.layers, self.frequencies, strict=True):
            layer.move(p0, p1, delta, freq.inv_freq)
        self._follow()

    def _follow(self) -> None:
        """Every layer's next position: one past the highest position any layer holds."""
        next_pos = max(layer.max_position() for layer in self.layers) + 1
        for layer in self.layers:
            layer.follow(next_pos)

    def loadable(self, positions: Sequence[torch.Tensor], n_past: int) -> int:
        """The longest prefix, at most ``n_past``, that :meth:`load_prefix` can load from states at
        ``positions[i]`` for layer ``i``: each layer must find every cell it needs."""
        ends = {n_past, min(n_past, self.n_keep), 0}
        for pos in positions:
            held = pos[pos < n_past]
            runs = torch.nonzero(torch.diff(torch.sort(held).values) != 1).squeeze(1)
            ends.update((torch.sort(held).values[runs] + 1).tolist())
        for n in sorted(ends, reverse=True):
            if all(_covers(layer, pos, n) for layer, pos in zip(self.layers, positions, strict=True)):
                return n
        return 0

    def load_prefix(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        n_past: int,
        positions: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Fill the cache with per-layer (B, Hkv, n, D) states (from a prompt-cache file) at ``positions[i]``
        (n,) for layer ``i`` (default: ``0, 1, ...``), of which the cells the first ``n_past`` positions
        need are loaded. ValueError if a layer lacks a cell it needs."""
        if len(keys) != len(self.layers):
            raise ValueError(f"{len(keys)} layers of states for a cache of {len(self.layers)} layers")
        positions = positions or [torch.arange(k.shape[-2]) for k in keys]
        for i, (layer, pos) in enumerate(zip(self.layers, positions, strict=True)):
            if not _covers(layer, pos, n_past):
                raise ValueError(f"layer {i} lacks cells the first {n_past} positions need")
        for layer, k, v, pos in zip(self.layers, keys, values, positions, strict=True):
            take = torch.nonzero((pos < n_past) & layer.is_needed(pos, n_past)).squeeze(1)
            take = take[torch.argsort(pos[take])]
            layer.fill(k.index_select(-2, take), v.index_select(-2, take), pos[take], n_past)

    def reserve(self, n: int) -> None:
        """Room in every layer for ``n`` cells claimed one by one next (:meth:`CellLayer.reserve`)."""
        for layer in self.layers:
            layer.reserve(n)

    def make_room(self, n_new: int) -> int:
        """Shift until ``n_new`` more tokens fit; returns the number of shifts made."""
        n_new = check_int(n_new, "n_new", 0)
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
        """One context shift: drop cells ``[n_keep, n_keep + n_discard)``, move the later ones down by
        ``n_discard`` (keys re-rotated)."""
        if not 1 <= n_discard <= self.n_past - self.n_keep:
            raise ValueError(
                f"cannot discard {n_discard} cells: {self.n_past} cached, {self.n_keep} kept"
                if n_discard
                else f"nothing left to discard: {self.n_past} cached, {self.n_keep} kept"
            )
        end = self.n_past
        self.remove(self.n_keep, self.n_keep + n_discard)
        self.move(self.n_keep + n_discard, end, -n_discard)
        self.shifts += 1
        self.discarded += n_discard
        self.last_shift = (end, n_discard)


def _covers(layer: CellLayer, positions: torch.Tensor, n_past: int) -> bool:
    """Whether cells at ``positions`` include every one ``layer`` needs after ``n_past`` tokens."""
    below = positions[positions < n_past]
    return int(layer.is_needed(below, n_past).sum()) == layer.needed(n_past)
