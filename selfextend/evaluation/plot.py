"""PNG plots from JSONL results: perplexity against length, passkey heatmaps, benchmark curves.

matplotlib is imported inside the functions (Agg backend), never when the library is imported.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from selfextend.core.validate import plural
from selfextend.evaluation.aggregate import fmt_tokens, summarize
from selfextend.evaluation.results import ResultsWarning


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
STYLES = ("-", "--", "-.", ":")


def _models(records: list[dict[str, Any]]) -> str:
    """The models of ``records``, each once in the order they come (a title's: not only the first's)."""
    return ", ".join(dict.fromkeys(str(r.get("model", "")) for r in records))


def _variant(record: dict[str, Any]) -> str:
    """A bench record's line: its variant, with the Self-Extend settings it ran with (records of runs with
    other G or W are other lines; records written before they were kept are named by variant alone)."""
    name = str(record["variant"])
    if name == "plain" or "group_size" not in record:
        return name
    return f"{name} G={record['group_size']} W={record['window']}"


def _line_style(i: int) -> dict[str, Any]:
    """Marker, dash and size for the ``i``-th line: lines that coincide stay visible under each other."""
    return {
        "color": f"C{i % 10}",
        "marker": MARKERS[i % len(MARKERS)],
        "linestyle": STYLES[i % len(STYLES)],
        "markersize": max(4.0, 9.0 - 1.2 * i),
        "markerfacecolor": "none",
        "markeredgewidth": 1.4,
        "linewidth": 1.6,
    }


def _plain_log_axis(axis) -> None:
    """Plain numbers (20, 50, 100) on a log axis instead of 2x10^1: 1-2-5 ticks, printed with %g."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


RATIO_TOP = 3.0  # the ratio view's y axis stops here; methods above it are labelled at the edge


def _clip_ratio_axis(ax, summary) -> None:
    """Keep the ratio view on the methods that work: values above RATIO_TOP are written at the top
    edge in their line's colour instead of stretching the axis."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    bottom = min(min(c.low for c in summary.cells.values()), 1.0) / 1.05
    top = min(max(max(c.high for c in summary.cells.values()), 1.0) * 1.05, RATIO_TOP)
    ax.set_ylim(bottom, top)
    for line in ax.get_lines():
        xs, ys = line.get_data()
        for x, y in zip(xs, ys, strict=True):
            if y > top:
                ax.annotate(
                    f"{y:.3g}x",
                    (x, top),
                    xytext=(0, -2),
                    textcoords="offset points",
                    ha="center",
                    va="top",
                    fontsize=8,
                    color=line.get_color(),
                    fontweight="bold",
                )
    ticks = [t for t in (0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.1, 1.2, 1.5, 2, 2.5, 3) if bottom <= t <= top]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _length_axis(ax, lengths: list[int], trained_window: int | None, stretch: bool = True) -> str:
    """Log2 length axis with a tick per measured length; the trained window gets a tick and a line.

    With ``stretch`` False a trained window outside the measured range is not drawn (the axis keeps to
    the data); the returned note says where it is instead ("" when it is drawn or unknown).
    """
    from matplotlib.ticker import NullLocator

    note = ""
    if trained_window and not stretch and not min(lengths) <= trained_window <= max(lengths):
        side = "beyond" if trained_window > max(lengths) else "below"
        note = f"trained window {fmt_tokens(trained_window)} tokens: {side} these lengths"
        trained_window = None
    ax.set_xscale("log", base=2)
    ticks = sorted(set(lengths) | ({trained_window} if trained_window else set()))
    labels = [fmt_tokens(n) + ("\ntrained" if n == trained_window else "") for n in ticks]
    ax.set_xticks(ticks, labels)
    ax.xaxis.set_minor_locator(NullLocator())
    if trained_window:
        ax.axvline(trained_window, color="grey", linestyle=(0, (4, 3)), linewidth=1, zorder=0)
        for label in ax.get_xticklabels():
            if label.get_text().endswith("trained"):
                label.set_fontweight("bold")
    return note


def plot_ppl(
    records: list[dict[str, Any]],
    out: str | Path,
    trained_window: int | None = None,
    field: str = "ppl_last",
    stat: str = "mean",
    per_doc: bool = False,
    ratio: bool = False,
    reference: int | None = None,
) -> Path:
    """PPL (log scale) against length (log2), a line per method, aggregated over documents.

    The line is ``stat`` over the documents and the band their min-max range (see
    :func:`selfextend.evaluation.aggregate.summarize`, which ``table`` prints: methods are compared over
    the documents they share). ``per_doc`` draws a panel per document instead; ``ratio`` draws each
    method's PPL over its own at ``reference``. A method with nothing to draw gets no legend entry.
    """
    plt = _pyplot()
    docs = sorted({r["doc"] for r in records})
    order = list(dict.fromkeys(r["method"] for r in records))
    groups = (
        [(doc, [r for r in records if r["doc"] == doc]) for doc in docs] if per_doc else [(None, records)]
    )
    fig, axes = plt.subplots(
        1,
        len(groups),
        figsize=(5.2 * len(groups) + 2.8, 4.6),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    summary = None
    rank: dict[str, int] = {}  # legend label -> the method's place in the sweep
    for ax, (doc, group) in zip(axes[0], groups, strict=True):
        summary = summarize(group, field, stat, ratio, reference, trained_window)
        for method in summary.methods:
            i = order.index(method)  # the same colour, marker and dash for a method in every panel
            cells = [(n, summary.cells[(method, n)]) for n in summary.lengths if (method, n) in summary.cells]
            if not cells:
                continue
            xs = [n for n, _ in cells]
            label = summary.label(method)
            rank[label] = i
            line = ax.plot(xs, [c.value for _, c in cells], label=label, **_line_style(i))[0]
            if any(c.n > 1 for _, c in cells):
                ax.fill_between(
                    xs,
                    [c.low for _, c in cells],
                    [c.high for _, c in cells],
                    color=line.get_color(),
                    alpha=0.12,
                )
        ax.set_yscale("log")
        if ratio:
            ax.axhline(1.0, color="black", linewidth=0.8, zorder=0)
            _clip_ratio_axis(ax, summary)
        else:
            _plain_log_axis(ax.yaxis)
        _length_axis(ax, summary.lengths, trained_window)
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, which="major", alpha=0.3)
        if doc:
            ax.set_title(doc, fontsize=9)
        else:
            shown = summary.documents
            over = "each method over its own of" if summary.method_docs else plural(len(shown), "document")
            ax.set_title(f"{over}: {', '.join(shown)}", fontsize=9)
    if ratio:
        label = f"PPL / PPL at {fmt_tokens(summary.reference)} (log scale, cut at {RATIO_TOP:g})"
    else:
        label = (
            "perplexity, last quarter of the context" if field == "ppl_last" else "perplexity"
        ) + " (log)"
    axes[0][0].set_ylabel(label)
    several = not per_doc and len(summary.documents) > 1
    spread = ", band: range over documents" if several else ""
    handles = {}
    for ax in axes[0]:
        for h, name in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(name, h)
    names = sorted(handles, key=rank.__getitem__)
    axes[0][-1].legend(
        [handles[n] for n in names],
        names,
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        fontsize=8,
        frameon=False,
    )
    model = _models(records)
    over = "per document" if per_doc else "one document"  # (one document was titled "per document" too)
    what = f"PPL over its own at {fmt_tokens(summary.reference)} tokens" if ratio else "Perplexity"
    fig.suptitle(f"{what} against context length, {stat if several else over}{spread} — {model}", fontsize=10)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def _text_colour(rgba: tuple[float, ...]) -> str:
    """Black on light cells, white on dark ones (relative luminance, sRGB weights)."""
    r, g, b = rgba[:3]
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.45 else "white"


def plot_passkey(records: list[dict[str, Any]], out: str | Path, trained_window: int | None = None) -> Path:
    """One heatmap per method: accuracy over length (columns) x depth (rows), hits/trials written in."""
    plt = _pyplot()
    cmap = plt.get_cmap("RdYlGn")
    methods = list(dict.fromkeys(r["method"] for r in records))
    lengths = sorted({r["length"] for r in records})
    depths = sorted({r["depth"] for r in records})
    width = max(3.5, 0.9 * len(lengths) + 1.5)
    fig, axes = plt.subplots(
        1,
        len(methods),
        figsize=(width * len(methods) + 1.5, 0.55 * len(depths) + 2.2),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    image = None
    for ax, method in zip(axes[0], methods, strict=True):
        grid = [[float("nan")] * len(lengths) for _ in depths]
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                hits = [
                    r["correct"]
                    for r in records
                    if r["method"] == method and r["length"] == n and r["depth"] == d
                ]
                if hits:
                    grid[i][j] = acc = sum(hits) / len(hits)
                    colour = _text_colour(cmap(acc))
                    ax.text(
                        j, i, f"{sum(hits)}/{len(hits)}", ha="center", va="center", fontsize=9, color=colour
                    )
        image = ax.imshow(grid, vmin=0, vmax=1, cmap=cmap, aspect="auto")
        labels = [fmt_tokens(n) + ("*" if trained_window and n > trained_window else "") for n in lengths]
        ax.set_xticks(range(len(lengths)), labels)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_title(method, fontsize=9)
    axes[0][0].set_ylabel("passkey depth (% of filler)")
    star = f"; * past the trained window ({fmt_tokens(trained_window)})" if trained_window else ""
    fig.supxlabel(
        f"prompt length (tokens)\n{star.lstrip('; ')}{'; ' if star else ''}empty: not measured", fontsize=10
    )
    fig.colorbar(image, ax=axes[0].tolist(), label="retrieval accuracy")
    fig.suptitle(f"Passkey retrieval — {_models(records)}")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def plot_bench(records: list[dict[str, Any]], out: str | Path, trained_window: int | None = None) -> Path:
    """Prefill time and peak memory against length, a line per variant (medians of the runs)."""
    import statistics

    plt = _pyplot()
    runs = [r for r in records if r.get("case") == "prefill" and not r.get("summary")]
    if not runs:
        raise ValueError("no prefill runs in these bench records (the plot draws prefill time and memory)")
    others = sorted({str(r.get("case")) for r in records if not r.get("summary")} - {"prefill"})
    if others:
        warnings.warn(f"{', '.join(others)} records not drawn: the plot draws prefill", ResultsWarning, 2)
    named = [(_variant(r), r) for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), layout="constrained")
    for ax, key, label in (
        (axes[0], "seconds", "prefill time (s)"),
        (axes[1], "peak_mib", "peak memory added (MiB)"),
    ):
        for name in sorted({v for v, _ in named}):
            lengths = sorted({r["length"] for v, r in named if v == name})
            values = [
                statistics.median(r[key] for v, r in named if v == name and r["length"] == n) for n in lengths
            ]
            ax.plot(lengths, values, label=name, **_line_style(len(ax.lines)))
        ax.set_yscale("log")
        _plain_log_axis(ax.yaxis)
        note = _length_axis(ax, sorted({r["length"] for r in runs}), trained_window, stretch=False)
        ax.set_xlabel("prefill length (tokens)" + (f"\n({note})" if note else ""))
        ax.set_ylabel(label + ", log scale")
        ax.grid(True, which="major", alpha=0.3)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    said = ("; ".join(dict.fromkeys(str(r.get(k, "")) for r in runs)) for k in ("model", "dtype", "device"))
    fig.suptitle(f"Prefill cost — {', '.join(said)}")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)
