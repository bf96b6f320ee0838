"""Which cells each exchange of a chat occupies, and context shifts that drop whole old exchanges.

A shift that cuts through a turn leaves the model a turn without its header, or a reply without
its end marker. So, when the cache is full, the chat drops the oldest whole exchanges (a user
turn and its reply) after the kept part: the fewest that free at least llama.cpp's half
(:func:`selfextend.kv.cache.discard_count`), else as many as there are, provided that frees enough
for the write. Only when no exchange boundary frees enough (one turn larger than the cache)
does it fall back to the token-level half. The cache itself moves and re-rotates the cells.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from selfextend.kv.cache import discard_count


@dataclass
class Exchange:
    """One user turn and the reply to it: their text, and where they start in the cache.

    ``start``/``reply_start`` are cache cells; ``None`` once a shift has removed that cell.
    """

    user: str
    reply: str = ""
    start: int | None = None
    reply_start: int | None = None


@dataclass
class ShiftReport:
    """One context shift inside a chat."""

    exchanges: int  # exchanges whose first cell was dropped
    tokens: int  # cells dropped
    whole: bool  # only whole exchanges went (False: the token-level fallback cut one)
    n_past: int  # cells in use after the shift


class TurnLedger:
    """Keeps the exchanges' cell positions in step with the cache's shifts and picks turn-aware shifts.

    Install :meth:`discard` as the cache's ``discard_policy``.
    """

    def __init__(self, exchanges: list[Exchange], on_shift: Callable[[ShiftReport], None] | None = None):
        self.exchanges = exchanges
        self.on_shift = on_shift
        self.dropped_exchanges = 0

    def boundaries(self, n_past: int, n_keep: int) -> list[int]:
        """Cells after the kept part where an exchange starts, up to ``n_past``."""
        return sorted({e.start for e in self.exchanges if e.start is not None and n_keep < e.start <= n_past})

    def choose(self, n_past: int, n_keep: int, n_need: int) -> int:
        """Cells to drop after ``n_keep``: whole exchanges if a boundary frees at least ``n_need``."""
        half = discard_count(n_past, n_keep)
        whole = [b - n_keep for b in self.boundaries(n_past, n_keep) if b - n_keep >= n_need]
        if whole:
            return next((d for d in whole if d >= half), whole[-1])
        return half

    def discard(self, n_past: int, n_keep: int, n_need: int) -> int:
        """The cache's discard policy: choose, then move every recorded position as the shift will."""
        n_discard = self.choose(n_past, n_keep, n_need)
        end = n_keep + n_discard

        def moved(p: int | None) -> int | None:
            if p is None or p < n_keep:
                return p
            return None if p < end else p - n_discard

        starts = {e.start for e in self.exchanges}
        # whole exchanges went: the dropped cells begin where one starts (or no exchange began in the kept
        # part, which is then the system part alone) and end where one starts (or at the last cell)
        whole = (n_keep in starts or all(p is None or p >= n_keep for p in starts)) and (
            end == n_past or end in starts
        )
        dropped = 0
        for e in self.exchanges:
            dropped += e.start is not None and n_keep <= e.start < end
            before = e.reply_start is not None and n_keep < e.reply_start <= end  # its turn's last cell goes
            e.start, e.reply_start = moved(e.start), None if before else moved(e.reply_start)
        self.dropped_exchanges += dropped
        if self.on_shift is not None:
            self.on_shift(ShiftReport(dropped, n_discard, whole, n_past - n_discard))
        return n_discard
