"""Context lengths as sweeps, passkey and bench take them: ``2k,4k,8192``, each a whole number of tokens.

Apart from the sweep (no torch here), so the command line refuses a bad ``--lengths`` at once, not after
the seconds of importing the model code.
"""

from __future__ import annotations

import re

from selfextend.core.validate import ValidationError, check_int

MAX_LENGTH = 2**24
"""Longest context a sweep accepts (16M tokens): far beyond any model, short of absurd allocations."""
MIN_LENGTH = 4  # the last quarter (ppl_last) of a shorter one holds no token
LENGTH = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(k?)")  # 2048, 2k, 1.5k; a sign, to say its range


def parse_lengths(spec: str, name: str = "lengths") -> list[int]:
    """``"1k,2k,4096"`` -> [1024, 2048, 4096] (k = 1024 tokens: ``1.5k`` is 1536, ``1.7k`` no whole count),
    each in [MIN_LENGTH, MAX_LENGTH]; sorted, unique; empty items skipped."""
    lengths = []
    for part in filter(None, (p.strip().lower() for p in str(spec).split(","))):
        what = f"{name} ({part})"
        found = LENGTH.fullmatch(part)
        if found is None:
            raise ValidationError(what, "is not a length: write a token count such as 2048, or 2k (k = 1024)")
        number, k = found.groups()
        n = float(number) * 1024 if k else float(number)
        if n > MAX_LENGTH:  # (a number of 400 digits is inf here)
            raise ValidationError(what, f"is more than {MAX_LENGTH:,} tokens, the longest length taken")
        if n < MIN_LENGTH:
            raise ValidationError(what, f"is {n:g} tokens: a length is at least {MIN_LENGTH}")
        if n != int(n):
            raise ValidationError(what, f"is {n:g} tokens: a length is a whole number of tokens")
        lengths.append(int(n))
    if not lengths:
        raise ValidationError(name, "needs at least one length, such as 2048 or 2k")
    return sorted(set(lengths))


def check_lengths(lengths: list[int], name: str = "lengths") -> list[int]:
    """Lengths given as numbers through the API: each an integer in [MIN_LENGTH, MAX_LENGTH]; sorted,
    unique."""
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise ValidationError(name, f"must be a list of token counts, got {type(lengths).__name__}")
    checked = [check_int(n, name, MIN_LENGTH, MAX_LENGTH) for n in lengths]
    if not checked:
        raise ValidationError(name, "needs at least one length")
    return sorted(set(checked))
