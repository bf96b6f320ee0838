"""Self-Extend position arithmetic: the one place these formulas live.

Query at position ``i``, key at ``j`` (``i >= j``), group size ``G``, neighbor window ``W``:
pairs with ``i - j < W`` use the normal positions; the others use the grouped positions
below. Integer (floor) division everywhere, in prefill and in decode alike.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from selfextend.core.validate import ValidationError, check_int

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
    """Longest sequence whose grouped distances stay inside the trained window: ``G * (L - W + W // G)``,
    the paper's ``(L - W) * G + W`` where G divides W and up to G - 1 tokens fewer where it does not (the
    last query's distance to key 0, ``(n - 1) // G + W - W // G``, must be at most ``L - 1``).

    Raises :class:`~selfextend.core.validate.ValidationError` where the sizes cannot work (G and W
    integers >= 1, W below the trained window L)."""
    trained_window = check_int(trained_window, "trained window", 2)
    group_size, window = validate(group_size, window, trained_window)
    return group_size * (trained_window - window + window // group_size)


def validate(group_size: int, window: int, trained_window: int | None = None) -> tuple[int, int]:
    """Refuse parameters that cannot work, with a one-line message; returns them as plain ints.

    Raises :class:`~selfextend.core.validate.ValidationError` (a ``ValueError``).
    """
    group_size = check_int(group_size, "group size", 1)
    window = check_int(window, "window", 1)
    if trained_window is not None and window >= trained_window:
        raise ValidationError(
            "window", f"({window}) must be smaller than the model's trained window ({trained_window})"
        )
    return group_size, window
