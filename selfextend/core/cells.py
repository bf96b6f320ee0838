"""Keys that carry their positions: what a KV cache of cells tells the attention kernels about the keys it
returns (transformers passes the attention function only tensors, so the cache attaches it to the keys)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from selfextend.core.rope import RotationTable

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
