"""Checks for every number a user gives, shared by the Python API and the command line.

One place decides what a valid group size, window, token count, probability or seed is, so the
CLI (through :mod:`selfextend.cli.options`' click types) and the library refuse the same values with the same
words. A refused value raises :class:`ValidationError` (a ``ValueError``) whose message names the
option and the allowed range, in one line.

Integers are ``int`` or NumPy integers, never ``bool`` (``True`` is not a group size) and never
floats (``4.0`` is refused rather than silently truncated); floats must be finite.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

MAX_INT = 2**31 - 1
"""Upper bound of counts (tokens, documents, repeats...) unless a check says otherwise."""
MAX_SEED = 2**63 - 1
GREEDY_BELOW = 1e-4
"""A temperature or top_p under this is greedy: dividing logits by a smaller temperature overflows float32
(and the distribution is one-hot to float precision anyway); a smaller top_p keeps only the top token."""
MAX_TEMPERATURE = 100.0  # past it the distribution is uniform to float precision; at inf, -inf / inf is NaN
PENALTY_RANGE = (0.01, 100.0)  # a repeat penalty near 0 divides a logit into an overflow


class ValidationError(ValueError):
    """A value an option does not accept. ``name`` is the option, ``requirement`` the rest of the line."""

    def __init__(self, name: str, requirement: str) -> None:
        self.name, self.requirement = name, requirement
        super().__init__(f"{name} {requirement}")


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_text(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    """``in [lo, hi]``, ``>= lo`` or ``<= hi``; the generic bound MAX_INT is left unsaid."""
    hi = None if hi == MAX_INT else hi
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {_num(hi)}"
    return ""


def check_int(value: Any, name: str, lo: int | None = None, hi: int | None = MAX_INT) -> int:
    """``value`` as an ``int`` when it is an integer (``int`` or NumPy integer, not ``bool``) in [lo, hi]."""
    what = " ".join(filter(None, ("an integer", _range_text(lo, hi))))
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValidationError(name, f"must be {what}, got {value!r} ({type(value).__name__})")
    value = int(value)
    if lo is not None and value < lo:
        raise ValidationError(name, f"must be {what}, got {value}")
    if hi is not None and value > hi:
        raise ValidationError(name, f"must be at most {hi}, got {value}")
    return value


def check_float(
    value: Any,
    name: str,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """``value`` as a finite ``float`` (ints and NumPy numbers accepted, ``bool`` not) in the range."""
    what = " ".join(filter(None, ("a finite number", _range_text(lo, hi, lo_open, hi_open))))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValidationError(name, f"must be {what}, got {value!r} ({type(value).__name__})")
    value = float(value)
    bad = not math.isfinite(value)
    bad = bad or (lo is not None and (value <= lo if lo_open else value < lo))
    bad = bad or (hi is not None and (value >= hi if hi_open else value > hi))
    if bad:
        raise ValidationError(name, f"must be {what}, got {value:g}")
    return value


def parse_int(text: Any, name: str, lo: int | None = None, hi: int | None = MAX_INT) -> int:
    """An integer written as text (a command-line value, a method parameter), then :func:`check_int`."""
    if isinstance(text, str):
        try:
            text = int(text.strip().replace("_", ""), 10)
        except ValueError:
            what = " ".join(filter(None, ("an integer", _range_text(lo, hi))))
            raise ValidationError(name, f"must be {what}, got {text!r}") from None
    return check_int(text, name, lo, hi)


def parse_float(text: Any, name: str, **bounds: Any) -> float:
    """A number written as text, then :func:`check_float` (so ``nan`` and ``inf`` are refused)."""
    if isinstance(text, str):
        try:
            text = float(text.strip())
        except ValueError:
            rng = _range_text(bounds.get("lo"), bounds.get("hi"))
            what = " ".join(filter(None, ("a finite number", rng)))
            raise ValidationError(name, f"must be {what}, got {text!r}") from None
    return check_float(text, name, **bounds)


def parse_seed(text: Any, name: str = "seed") -> int | None:
    """A seed written as text (or None), then :func:`check_seed`."""
    return None if text is None else parse_int(text, name, 0, MAX_SEED)


def check_seed(value: Any, name: str = "seed") -> int | None:
    """A random seed: None (fresh randomness) or an integer in [0, 2**63 - 1]."""
    return None if value is None else check_int(value, name, 0, MAX_SEED)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when the message is empty)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0].strip()


def one_line(message: object) -> str:
    """A message folded onto one line, for errors printed to users as-is."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 exchange``, ``2 exchanges``, ``0 replies`` (``many`` when adding an s is wrong)."""
    return f"{n} {word if n == 1 else many or word + 's'}"
