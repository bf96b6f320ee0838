"""Which records of a results file a plot or table reads: their kind (the most common one), and those of
that kind with every field it reads, of the right type and range; each point once (its last record), and
each method named with its model and dtype where the file holds several. What is skipped is said in one
:class:`~selfextend.evaluation.results.ResultsWarning` a reason.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from selfextend.evaluation.aggregate import distinct_texts, one_prompt_form
from selfextend.evaluation.results import ResultsWarning, record_kind

_NEEDS = {
    "ppl": {"doc": str, "method": str, "length": int},
    "passkey": {"method": str, "length": int, "depth": float, "correct": bool},
    "bench": {"case": str, "variant": str},
}


def _fits(record: dict[str, Any], kind: str, field: str) -> bool:
    """Whether ``record`` has every field a ``kind`` plot reads, of the right type."""
    needs = dict(_NEEDS[kind], **({field: float} if kind == "ppl" else {}))
    if kind == "bench" and record.get("case") == "prefill" and not record.get("summary"):
        needs.update(length=int, seconds=float, peak_mib=float)
    for name, want in needs.items():
        value = record.get(name)
        if want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok and (value >= 1 or name != field or kind != "ppl")  # a perplexity is at least 1
            ok = ok and (name != "depth" or 0 <= value <= 1)  # a relative depth: 7 was counted
        elif want is int:  # a count: a hand-edited length of -2048 was tabled as a column
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        else:
            ok = isinstance(value, want)
        if not ok:
            return False
    return True


def records_kind(records: list[dict[str, Any]], source: str = "results") -> str:
    """``ppl``, ``passkey`` or ``bench``: the most common kind among ``records`` (ValueError if none)."""
    if not records:
        raise ValueError(f"{source}: no records (no line of it is a result)")
    kinds = [k for r in records for k in [record_kind(r)] if k]
    if not kinds:
        raise ValueError(f"{source}: unknown records (fields: {', '.join(sorted(records[0]))})")
    return max(_NEEDS, key=kinds.count)


def usable_records(
    records: list[dict[str, Any]], field: str = "ppl_last", source: str = "results"
) -> tuple[str, list[dict[str, Any]]]:
    """The records' kind (the most common one) and those of them a plot or table can use.

    Records of another kind, or missing a field the plot reads (or holding a non-finite or mistyped
    value there), are skipped with one :class:`~selfextend.evaluation.results.ResultsWarning` saying how many;
    ValueError when none is left.
    """
    kind = records_kind(records, source)
    usable = [r for r in records if record_kind(r) == kind and _fits(r, kind, field)]
    other = len(records) - sum(k == kind for k in map(record_kind, records))
    broken = len(records) - other - len(usable)
    if other:
        warnings.warn(f"{source}: {other} record(s) not of kind {kind} skipped", ResultsWarning, stacklevel=2)
    if broken:
        what = f"'{field}' or other fields" if kind == "ppl" else "fields"
        warnings.warn(
            f"{source}: {broken} {kind} record(s) missing {what}, or holding a value out of their range "
            "(not a finite number, a perplexity below 1, a length that is no count), skipped",
            ResultsWarning,
            stacklevel=2,
        )
    if not usable:
        raise ValueError(f"{source}: no {kind} record has every field a plot or table reads")
    if kind == "ppl":
        usable = distinct_texts(usable)
    elif kind == "passkey":
        usable = one_prompt_form(usable)
    return kind, _one_per_point(_per_run(usable, kind), kind)


def _per_run(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """``records`` with each method named with its model and dtype where the file holds several of those
    (a sweep of another model appended to the same file: its own rows and lines, not averaged in)."""
    if kind == "bench":
        return records
    runs = {(r.get("model"), r.get("dtype")) for r in records}
    if len(runs) < 2:
        return records
    return [{**r, "method": f"{r.get('model')} {r.get('dtype')} {r['method']}"} for r in records]


def _one_per_point(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The last record of each point (a point measured twice, as two runs appending to one file do, counts
    once: a passkey trial twice would count twice in the accuracy)."""
    if kind == "bench":
        return records
    from selfextend.evaluation.passkey import point_key as passkey_key
    from selfextend.evaluation.sweep import point_key as ppl_key

    key = ppl_key if kind == "ppl" else passkey_key
    return list({key(r): r for r in records}.values())
