"""PNG plots from JSONL results: perplexity against length, passkey heatmaps, benchmark curves.

matplotlib is imported inside the functions (Agg backend), never when the library is imported.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def record_kind(records: list[dict[str, Any]]) -> str:
    """``ppl``, ``passkey`` or ``bench``, from the fields of the records."""
    if not records:
        raise ValueError("no records to plot")
    keys = set(records[0])
    if {"ppl", "length", "method"} <= keys:
        return "ppl"
    if {"correct", "depth", "method"} <= keys:
        return "passkey"
    if {"case", "variant"} <= keys:
        return "bench"
    raise ValueError(f"unknown records (fields: {', '.join(sorted(keys))})")


def _fmt_tokens(n: float) -> str:
    return f"{n / 1024:g}k" if n >= 1024 else f"{n:g}"


def plot_ppl(
    records: list[dict[str, Any]], out: str | Path, trained_window: int | None = None, field: str = "ppl_last"
) -> Path:
    """One panel per document: ``field`` (log scale) against length (log2), a line per method."""
    plt = _pyplot()
    docs = sorted({r["doc"] for r in records})
    fig, axes = plt.subplots(1, len(docs), figsize=(6 * len(docs), 4.5), squeeze=False, sharey=True)
    for ax, doc in zip(axes[0], docs, strict=True):
        by_method: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in records:
            if r["doc"] == doc:
                by_method[r["method"]].append((r["length"], r[field]))
        for method, points in sorted(by_method.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
        if trained_window:
            ax.axvline(trained_window, color="grey", linestyle="--", linewidth=1)
            ax.text(
                trained_window,
                0.97,
                " trained window",
                transform=ax.get_xaxis_transform(),
                color="grey",
                va="top",
                fontsize=8,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        lengths = sorted({r["length"] for r in records})
        ax.set_xticks(lengths, [_fmt_tokens(n) for n in lengths])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(doc)
        ax.grid(True, which="both", alpha=0.3)
    what = "last quarter of the context" if field == "ppl_last" else "whole context"
    axes[0][0].set_ylabel(f"perplexity, {what} (log scale)")
    axes[0][-1].legend(fontsize=8)
    model = records[0].get("model", "")
    fig.suptitle(f"Perplexity against context length — {model}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def plot_passkey(records: list[dict[str, Any]], out: str | Path, trained_window: int | None = None) -> Path:
    """One heatmap per method: accuracy over length (columns) x depth (rows), values written in."""
    plt = _pyplot()
    methods = sorted({r["method"] for r in records})
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
                    grid[i][j] = sum(hits) / len(hits)
                    ax.text(j, i, f"{sum(hits)}/{len(hits)}", ha="center", va="center", fontsize=8)
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        labels = [_fmt_tokens(n) + ("*" if trained_window and n > trained_window else "") for n in lengths]
        ax.set_xticks(range(len(lengths)), labels)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_title(method, fontsize=9)
    axes[0][0].set_ylabel("passkey depth (% of filler)")
    star = f"; * past the trained window ({_fmt_tokens(trained_window)})" if trained_window else ""
    fig.supxlabel(f"prompt length (tokens{star})", fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), label="retrieval accuracy")
    fig.suptitle(f"Passkey retrieval — {records[0].get('model', '')}")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)


def plot_bench(records: list[dict[str, Any]], out: str | Path, trained_window: int | None = None) -> Path:
    """Prefill time and peak memory against length, a line per variant (medians of the runs)."""
    import statistics

    plt = _pyplot()
    runs = [r for r in records if r.get("case") == "prefill" and not r.get("summary")]
    if not runs:
        raise ValueError("no prefill runs in these bench records")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in (
        (axes[0], "seconds", "prefill time (s)"),
        (axes[1], "peak_mib", "peak memory added (MiB)"),
    ):
        for name in sorted({r["variant"] for r in runs}):
            lengths = sorted({r["length"] for r in runs if r["variant"] == name})
            values = [
                statistics.median(r[key] for r in runs if r["variant"] == name and r["length"] == n)
                for n in lengths
            ]
            ax.plot(lengths, values, marker="o", label=name)
        if trained_window:
            ax.axvline(trained_window, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        lengths = sorted({r["length"] for r in runs})
        ax.set_xticks(lengths, [_fmt_tokens(n) for n in lengths])
        ax.set_xlabel("prefill length (tokens)")
        ax.set_ylabel(label + ", log scale")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    r0 = runs[0]
    fig.suptitle(f"Prefill cost — {r0.get('model', '')}, {r0.get('dtype', '')}, {r0.get('device', '')}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)
