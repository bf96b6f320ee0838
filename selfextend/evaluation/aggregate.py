"""Results across documents: one number (and its spread) per method and length, for plots and tables.

``plot`` and ``table`` both call :func:`summarize`, so a table shows exactly the numbers its plot
draws. Perplexity is aggregated over documents by a statistic (mean by default) with the min-max
range of the documents as its spread; the ratio view divides each document's PPL by that
document's PPL at a reference length under the same method *before* aggregating, so a method that
keeps PPL flat sits at 1 whatever the documents' own difficulty. Passkey results become accuracy
(hits over trials, all depths together).

Methods are compared over the same documents: when they were measured on different ones (a method
added to a sweep on fewer documents), only the documents every method has count, with a warning. When
no document is shared by all, each method keeps its own and its document count goes beside its name.
A method with no PPL at the ratio view's reference length is left out of that view, with a warning.
"""

from __future__ import annotations

import statistics
import warnings
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from selfextend.core.validate import plural
from selfextend.evaluation.results import FIRST_PROMPT, ResultsWarning

STATS: dict[str, Callable[[list[float]], float]] = {
    "mean": statistics.fmean,
    "median": statistics.median,
    "gmean": statistics.geometric_mean,
    "min": min,
    "max": max,
}
FORMATS = ("markdown", "csv", "latex")
Records = list[dict[str, Any]]


class AggregateError(ValueError):
    """Results that cannot be summarised as asked (unknown statistic, missing reference length...)."""


@dataclass
class Cell:
    """One (method, length) entry: the aggregate ``value``, the documents' range, and how many there were.

    For passkey results ``value`` is the accuracy, ``hits`` of ``n`` trials.
    """

    value: float
    low: float
    high: float
    n: int
    hits: int | None = None


@dataclass
class Summary:
    """Methods by lengths. ``kind`` is ``ppl`` or ``passkey``; ``what`` says what the numbers are.

    ``documents``: those the numbers are over. ``method_docs``: each method's document count, set only
    when no document is shared by every method (each is then over its own).
    """

    kind: str
    what: str
    methods: list[str]
    lengths: list[int]
    cells: dict[tuple[str, int], Cell] = field(default_factory=dict)
    model: str = ""
    reference: int | None = None
    documents: list[str] = field(default_factory=list)
    method_docs: dict[str, int] = field(default_factory=dict)

    def label(self, method: str) -> str:
        """The method's name, with its document count when methods are over different documents."""
        n = self.method_docs.get(method)
        return method if n is None else f"{method} ({plural(n, 'doc')})"

    def docs_of(self, method: str) -> int:
        """How many documents a full cell of ``method`` is over."""
        return self.method_docs.get(method, len(self.documents))

    def caption(self) -> str:
        """One line: which statistic of which field, over which documents."""
        if self.kind == "passkey":
            return f"{self.what}: hits/trials over all depths"
        if self.method_docs:
            return f"{self.what}; each method over its own documents ({', '.join(self.documents)})"
        return f"{self.what}, over {plural(len(self.documents), 'document')}: {', '.join(self.documents)}"


def reference_length(
    lengths: list[int], trained_window: int | None, shared: Collection[int] | None = None
) -> int:
    """The default reference of the ratio view: the longest measured length within the trained window
    among those every method measured (``shared``; where none is, among all: the methods without it are
    then left out, said)."""
    inside = [n for n in lengths if trained_window is None or n <= trained_window]
    if not inside:
        raise AggregateError(f"no measured length within the trained window ({trained_window} tokens)")
    common = [n for n in inside if shared is None or n in shared]
    return max(common or inside)


def summarize(
    records: list[dict[str, Any]],
    field: str = "ppl_last",
    stat: str = "mean",
    ratio: bool = False,
    reference: int | None = None,
    trained_window: int | None = None,
) -> Summary:
    """Aggregate ppl or passkey ``records`` into methods x lengths (see the module docstring).

    ``field`` picks ``ppl_last`` or ``ppl``; ``stat`` one of :data:`STATS`; with ``ratio`` each value
    is relative to the method's PPL at ``reference`` (default :func:`reference_length`).
    """
    if stat not in STATS:
        raise AggregateError(f"unknown statistic '{stat}': use {', '.join(STATS)}")
    if not records:
        raise AggregateError("no records")
    methods = list(dict.fromkeys(r["method"] for r in records))  # in the order the sweep ran them
    lengths = sorted({r["length"] for r in records})
    model = str(records[0].get("model", ""))
    if "correct" in records[0]:
        return _passkey(records, methods, lengths, model)
    records, documents, method_docs = _shared_documents(records)
    values: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)  # (method, length) -> doc -> ppl
    for r in records:
        values[(r["method"], r["length"])][r["doc"]] = float(r[field])
    what = "perplexity, last quarter of the context" if field == "ppl_last" else "perplexity, whole context"
    what = f"{what} ({field})"
    if ratio:
        measured = [{n for (m, n), docs in values.items() if m == k and docs} for k in methods]
        every = set.intersection(*measured)  # the lengths every method measured
        reference = reference or reference_length(lengths, trained_window, every)
        if reference not in lengths:
            raise AggregateError(f"reference length {reference} was not measured ({lengths})")
        missing = [m for m in methods if not values.get((m, reference))]
        if missing:
            warnings.warn(
                f"no PPL at the reference length {reference} for {', '.join(missing)}: "
                "left out of the ratio view",
                ResultsWarning,
                stacklevel=2,
            )
            methods = [m for m in methods if m not in missing]
            if not methods:
                raise AggregateError(f"no method has a PPL at the reference length {reference}")
        values = {
            (method, n): {d: v / base[d] for d, v in docs.items() if d in base}
            for (method, n), docs in values.items()
            for base in [values.get((method, reference), {})]
        }
        what = f"{what}, relative to {reference} tokens"
    summary = Summary(
        "ppl",
        f"{stat} {what}",
        methods,
        lengths,
        model=model,
        reference=reference,
        documents=documents,
        method_docs=method_docs,
    )
    for key, docs in values.items():
        if docs and key[0] in methods:
            vs = list(docs.values())
            summary.cells[key] = Cell(STATS[stat](vs), min(vs), max(vs), len(vs))
    summary.lengths = sorted({n for _, n in summary.cells})  # no empty column for what was left out
    partial = sum(c.n < summary.docs_of(m) for (m, _), c in summary.cells.items())
    if partial:
        warnings.warn(
            f"{plural(partial, 'cell')} over fewer documents than the rest of its method "
            "(a point not measured on every document; marked [n of N docs] in tables)",
            ResultsWarning,
            stacklevel=2,
        )
    return summary


def distinct_texts(records: Records) -> Records:
    """``records`` with a document name that holds several texts (``text``: another file of the same name,
    another dataset's ``train-0``) split into one document per text, named ``NAME [first digits of the
    text's id]``, with a warning: their numbers are of different texts, never one cell's. A record without
    ``text`` (written before it was recorded) stays under the plain name."""
    texts: dict[str, set[str]] = defaultdict(set)
    for r in records:
        if r.get("text"):
            texts[r["doc"]].add(r["text"])
    split = sorted(doc for doc, ids in texts.items() if len(ids) > 1)
    if not split:
        return records
    warnings.warn(
        f"{', '.join(split)}: records of {plural(max(len(texts[d]) for d in split), 'text')} under one name "
        "(another file or dataset of that name): each text is its own document, named with its text id",
        ResultsWarning,
        stacklevel=2,
    )
    return [
        {**r, "doc": f"{r['doc']} [{r['text'][:8]}]"} if r["doc"] in split and r.get("text") else r
        for r in records
    ]


def one_prompt_form(records: Records) -> Records:
    """Passkey ``records`` of the newest prompt form only (``prompt``; :data:`FIRST_PROMPT` where a record
    predates it), with a warning naming how many trials of older forms are left out: hits of two prompts
    are not one accuracy."""
    forms = {r.get("prompt", FIRST_PROMPT) for r in records}
    if len(forms) < 2:
        return records
    newest = max(forms)
    kept = [r for r in records if r.get("prompt", FIRST_PROMPT) == newest]
    warnings.warn(
        f"{plural(len(records) - len(kept), 'trial')} of an older passkey prompt left out: the numbers are "
        f"of prompt form {newest} only (the same command asks them again in it)",
        ResultsWarning,
        stacklevel=2,
    )
    return kept


def _shared_documents(
    records: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[str], dict[str, int]]:
    """The records over the documents every method has, those documents, and (only when no document is
    shared by all) each method's document count; a warning says what was left out."""
    by_method: dict[str, set[str]] = defaultdict(set)
    for r in records:
        by_method[r["method"]].add(r["doc"])
    every = set().union(*by_method.values())
    shared = set.intersection(*by_method.values())
    if shared == every:
        return records, sorted(every), {}
    if not shared:
        warnings.warn(
            "no document was measured with every method: each method's numbers are over its own "
            "documents, which are not comparable (document counts beside the names)",
            ResultsWarning,
            stacklevel=3,
        )
        return records, sorted(every), {m: len(d) for m, d in by_method.items()}
    fewer = [m for m, d in by_method.items() if d != every]
    warnings.warn(
        f"{', '.join(fewer)} measured fewer documents than the other methods: every method is compared "
        f"over the {plural(len(shared), 'document')} all share ({', '.join(sorted(shared))}); "
        f"left out: {', '.join(sorted(every - shared))}",
        ResultsWarning,
        stacklevel=3,
    )
    return [r for r in records if r["doc"] in shared], sorted(shared), {}


def _passkey(records: list[dict[str, Any]], methods: list[str], lengths: list[int], model: str) -> Summary:
    summary = Summary("passkey", "passkey retrieval accuracy", methods, lengths, model=model)
    for method in methods:
        for n in lengths:
            hits = [bool(r["correct"]) for r in records if r["method"] == method and r["length"] == n]
            if hits:
                acc = sum(hits) / len(hits)
                summary.cells[(method, n)] = Cell(acc, acc, acc, len(hits), sum(hits))
    return summary


def fmt_tokens(n: float) -> str:
    """2048 -> ``2k``, 1536 -> ``1.5k``, 500 -> ``500``."""
    return f"{n / 1024:g}k" if n >= 1024 else f"{n:g}"


def _cell_text(summary: Summary, method: str, cell: Cell | None) -> str:
    if cell is None:
        return ""
    if summary.kind == "passkey":
        return f"{cell.hits}/{cell.n}"
    digits = 3 if summary.reference else 2
    text = f"{cell.value:.{digits}f}"
    if cell.n > 1:
        text += f" ({cell.low:.{digits}f}-{cell.high:.{digits}f})"
    if cell.n < summary.docs_of(method):
        text += f" [{cell.n} of {summary.docs_of(method)} docs]"
    return text


def format_table(summary: Summary, fmt: str = "markdown") -> str:
    """The summary as a Markdown, CSV or LaTeX table: a row per method, a column per length.

    PPL cells read ``value (min-max over documents)`` when there are several documents; CSV gives the
    value, low, high and document count as separate columns instead. Markdown and LaTeX start with
    :meth:`Summary.caption` (which statistic of which field, over which documents).
    """
    if fmt not in FORMATS:
        raise AggregateError(f"unknown table format '{fmt}': use {', '.join(FORMATS)}")
    heads = [fmt_tokens(n) for n in summary.lengths]
    rows = [
        [_cell_text(summary, m, summary.cells.get((m, n))) for n in summary.lengths] for m in summary.methods
    ]
    names = [summary.label(m) for m in summary.methods]
    if fmt == "csv":
        return _csv(summary)
    if fmt == "markdown":
        lines = [summary.caption(), "", f"| method | {' | '.join(heads)} |", "|---|" + "---:|" * len(heads)]
        lines += [f"| {m} | {' | '.join(r)} |" for m, r in zip(names, rows, strict=True)]
        return "\n".join(lines)

    def esc(text: str) -> str:
        """LaTeX's special characters as text (an ``&`` in a model's name split the row's cells)."""
        special = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_"}
        special |= {"{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
        return "".join(special.get(c, c) for c in text)

    lines = [
        f"% {summary.caption()}",
        r"\begin{tabular}{l" + "r" * len(heads) + "}",
        r"\hline",
        "method & " + " & ".join(heads) + r" \\",
        r"\hline",
    ]
    lines += [f"{esc(m)} & " + " & ".join(r) + r" \\" for m, r in zip(names, rows, strict=True)]
    lines += [r"\hline", r"\end{tabular}"]
    return "\n".join(lines)


def _csv(summary: Summary) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    if summary.kind == "passkey":
        writer.writerow(["method", "length", "accuracy", "hits", "trials"])
    else:
        writer.writerow(["method", "length", "value", "low", "high", "documents"])
    for m in summary.methods:
        for n in summary.lengths:
            c = summary.cells.get((m, n))
            if c is None:
                continue
            if summary.kind == "passkey":
                writer.writerow([m, n, f"{c.value:.4g}", c.hits, c.n])
            else:
                writer.writerow([m, n, f"{c.value:.6g}", f"{c.low:.6g}", f"{c.high:.6g}", c.n])
    return buf.getvalue().rstrip("\n")
