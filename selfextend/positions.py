"""Self-Extend position arithmetic: the one place these formulas live.

Query at position ``i``, key at ``j`` (``i >= j``), group size ``G``, neighbor window ``W``:
pairs with ``i - j < W`` use the normal positions; the others use the grouped positions
below. Integer (floor) division everywhere, in prefill and in decode alike.
"""

from __future__ import annotations

from typing import TypeVar

import torch

Position = TypeVar("Position", int, torch.Tensor)


def grouped_key_positions(pos: Position, group_size: int) -> Position:
    """Key position ``j`` -> ``j // G`` (a Python int or a tensor of them)."""
    return pos // group_size


def grouped_query_positions(pos: Position, group_size: int, window: int) -> Position:
    """Query position ``i`` -> ``i // G + W - W // G``, so that distance ``W`` maps to about ``W``."""
    return pos // group_size + (window - window // group_size)


def is_neighbor(distance: torch.Tensor, window: int) -> torch.Tensor:
    """True where a query-key distance ``i - j`` is inside the neighbor window."""
    return distance < window


def max_length(trained_window: int, group_size: int, window: int) -> int:
    """Longest sequence whose grouped distances stay inside the trained window: ``(L - W) * G + W``."""
    return (trained_window - window) * group_size + window


def validate(group_size: int, window: int, trained_window: int | None = None) -> None:
    """Refuse parameters that cannot work, with a one-line message."""
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group size must be an integer >= 1, got {group_size!r}")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    if trained_window is not None and window >= trained_window:
        raise ValueError(
            f"window ({window}) must be smaller than the model's trained window ({trained_window})"
        )
