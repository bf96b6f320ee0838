"""Keys that carry their positions: what a KV cache of cells tells the attention kernels about the keys it
returns (transformers passes the attention function only tensors, so the cache attaches it to the keys)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

from selfextend.core.rope import RotationTable

T = TypeVar("T")

GroupedSource = Callable[[int, torch.Tensor, int, RotationTable | None], torch.Tensor]
"""``(group_size, inv_freq, n, rotations) -> (B, Hkv, n, D)``: the first ``n`` keys at their grouped
positions (``rotations``: a table shared by the layers, for the few keys a decode step adds)."""


@dataclass(frozen=True)
class KeyCells:
    """Where the keys of one attention call sit: ``positions`` (Lk,) int64, increasing (or (B, Lk), one row
    per sequence, for keys no cache tagged); ``first`` the first
    position when they are gapless (``first, first + 1, ...``), else None; ``grouped`` the keys at grouped
    positions as their owner keeps them (None: rotate them here)."""

    positions: torch.Tensor
    first: int | None
    grouped: GroupedSource | None = None

    def drop(self, n: int) -> KeyCells:
        """The cells after the first ``n`` (a row's left padding), without ``grouped`` (its slots moved)."""
        return KeyCells(self.positions[n:], None if self.first is None else self.first + n)


CELLS = "selfextend_cells"


def tag_cells(keys: torch.Tensor, cells: KeyCells) -> torch.Tensor:
    """Attach ``cells`` to ``keys`` (a cache's view, returned to the model), for :func:`cells_of`."""
    setattr(keys, CELLS, cells)
    return keys


def cells_of(keys: torch.Tensor) -> KeyCells | None:
    """The :class:`KeyCells` a cache attached to ``keys``; None for untagged keys, which are gapless and
    end at the last query (transformers' own caches, or no cache)."""
    return getattr(keys, CELLS, None)


_READS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # positions' tensor -> {(what, view): (version, value)}


def read_once(positions: torch.Tensor, what: Hashable, compute: Callable[[], T]) -> T:
    """``compute()``, a value read from ``positions`` on the host, once per positions tensor and ``what``:
    each read waits for the GPU, and transformers hands every layer of a forward the same position ids (as
    views of one tensor), so a read per layer left the GPU idle while the host prepared each layer. Kept
    by the tensor the views share (held weakly: a new forward's ids are a new tensor) and the view's place
    in it, read again after an in-place edit (its version)."""
    owner = positions if positions._base is None else positions._base
    if torch.compiler.is_compiling() or owner.is_inference():  # (no version counter to read)
        return compute()
    view = (what, positions.data_ptr(), tuple(positions.shape), tuple(positions.stride()))
    held = _READS.setdefault(owner, {})
    found = held.get(view)
    if found is not None and found[0] == owner._version:
        return found[1]
    value = compute()
    held[view] = (owner._version, value)
    return value
