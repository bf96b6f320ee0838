"""Print a JSONL results file as the Markdown table the README shows.

python experiments/table.py experiments/results/ppl_sweep.jsonl
"""

from __future__ import annotations

import sys
from collections import defaultdict

from selfextend.plot import record_kind
from selfextend.results import read_jsonl


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def main(path: str) -> None:
    records = read_jsonl(path)
    kind = record_kind(records)
    lengths = sorted({r["length"] for r in records})
    if kind == "ppl":
        for field, title in (("ppl_last", "last quarter of the context"), ("ppl", "whole context")):
            print(f"\nPPL, {title}:\n")
            print("| document | method | " + " | ".join(_k(n) for n in lengths) + " |")
            print("|---|---|" + "---:|" * len(lengths))
            rows = defaultdict(dict)
            for r in records:
                rows[(r["doc"], r["method"])][r["length"]] = r[field]
            for (doc, method), vals in sorted(rows.items()):
                cells = [f"{vals[n]:.2f}" if n in vals else "" for n in lengths]
                print(f"| {doc} | {method} | " + " | ".join(cells) + " |")
    else:
        print("| method | " + " | ".join(_k(n) for n in lengths) + " |")
        print("|---|" + "---:|" * len(lengths))
        for method in sorted({r["method"] for r in records}):
            cells = []
            for n in lengths:
                hits = [r["correct"] for r in records if r["method"] == method and r["length"] == n]
                cells.append(f"{sum(hits)}/{len(hits)}" if hits else "")
            print(f"| {method} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
