"""A full-attention layer's keys at their Self-Extend grouped positions, kept in step with its cells.

A key's grouped position ``j // G`` does not depend on the query, so while decoding only the newest
grouped key needs rotating. The layer that owns the cells says exactly which slots changed (a write, a
removal, a move), so the buffer never has to guess whether its contents are still current.
"""

from __future__ import annotations

import torch

from selfextend.core.decode_query import grouped_keys
from selfextend.core.positions import grouped_key_positions
from selfextend.core.rope import RotationTable

FEW = 4
"""Up to this many new grouped keys are rotated one by one through a shared :class:`RotationTable` (a decode
step adds one, at the same delta in every layer: one table entry serves them all)."""
AHEAD = 64
"""Where the owner says which slots hold written keys, a rotation covers at least this many of them past the
ones asked for: a decode step's query asks for one more grouped key per step, so 63 steps in 64 rotate
none (a rotation costs a few torch calls per layer, whatever its size)."""


class GroupedKeys:
    """Slots ``[0, valid)`` of ``buf`` hold the owner's keys of those slots at grouped positions, for one
    group size and one set of inverse frequencies (another of either starts over)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None  # (B, Hkv, capacity, D), allocated at the first use
        self.valid = 0
        self.settings: tuple[int, torch.Tensor, int] | None = None

    def invalidate(self, slot: int) -> None:
        """Forget the grouped keys of slots from ``slot`` on (their cells were written, removed or moved)."""
        self.valid = min(self.valid, slot)

    def _fits(self, keys: torch.Tensor) -> bool:
        """Whether ``buf`` is the grouped counterpart of ``keys``: their shape, type and device."""
        buf = self.buf
        return buf is not None and (buf.shape, buf.dtype, buf.device) == (keys.shape, keys.dtype, keys.device)

    def _same(self, group_size: int, inv_freq: torch.Tensor) -> bool:
        """Whether the slots held are for this group size and these very inverse frequencies, unchanged."""
        s = self.settings
        return s is not None and s[1] is inv_freq and s[0] == group_size and s[2] == inv_freq._version

    def held(
        self, keys: torch.Tensor, n: int, group_size: int, inv_freq: torch.Tensor
    ) -> torch.Tensor | None:
        """``buf`` (B, Hkv, capacity, D) when its slots [0, n) are current for ``keys`` and these settings
        (what :meth:`get` reads back without rotating anything), else None: a decode step's check per layer,
        a few attribute reads where :meth:`get` is a dozen torch calls."""
        return self.buf if n <= self.valid and self._same(group_size, inv_freq) and self._fits(keys) else None

    def get(
        self,
        keys: torch.Tensor,
        positions: torch.Tensor,
        group_size: int,
        inv_freq: torch.Tensor,
        n: int,
        rotations: RotationTable | None = None,
        first: int | None = None,
        ready: int | None = None,
    ) -> torch.Tensor:
        """Grouped keys of slots [0, n) of ``keys`` (B, Hkv, capacity, D) at ``positions`` (capacity,): the
        slots not yet current are rotated, the rest read back. ``first``: the position of slot 0 when the
        positions are gapless (then a few new keys go through ``rotations``); ``ready``: slots ``[0, ready)``
        hold written keys (then up to :data:`AHEAD` of them past ``n`` are rotated too)."""
        buf = self.buf
        dtype = keys.dtype  # rotated in float32, rounded to the cache's type: no float32 copy of every key
        fits = self._fits(keys)
        if not fits:
            self.buf = buf = torch.empty_like(keys, dtype=dtype)
        if not fits or not self._same(group_size, inv_freq):
            self.valid, self.settings = 0, (group_size, inv_freq, inv_freq._version)
        a = self.valid
        b = n if ready is None or n <= a else max(n, min(n + AHEAD, ready))
        if a < b <= a + FEW and rotations is not None and first is not None:
            for s in range(a, b):
                delta = grouped_key_positions(first + s, group_size) - (first + s)
                buf[..., s : s + 1, :] = rotations.rotate(keys[..., s : s + 1, :].to(dtype), delta, inv_freq)
        elif b > a:
            buf[..., a:b, :] = grouped_keys(keys[..., a:b, :].to(dtype), positions[a:b], group_size, inv_freq)
        self.valid = max(a, b)
        return buf[..., :n, :]
