"""Print int8- and int4-weight perplexities next to float32 ones from one JSONL file, with their ratios.

python experiments/quality/int8_table.py experiments/quality/results/int8_quality.jsonl
"""

from __future__ import annotations

import sys

from selfextend.evaluation.results import read_jsonl

FORMATS = ("int8", "int4")


def main(path: str) -> None:
    records = read_jsonl(path)
    by_weights: dict[str, dict[tuple, float]] = {}
    for r in records:
        _, _, weights = r["model"].partition("+")
        by_weights.setdefault(weights or "float32", {})[(r["doc"], r["method"], r["length"])] = r["ppl"]
    floats = by_weights.get("float32", {})
    shown = [w for w in FORMATS if w in by_weights]
    print(
        "| document | method | length | PPL float32 | "
        + " | ".join(f"PPL {w} | {w} / float32" for w in shown)
        + " |"
    )
    print("|---|---|---:|---:|" + "---:|---:|" * len(shown))
    for key, base in floats.items():
        cells = []
        for w in shown:
            ppl = by_weights[w].get(key)
            cells += ["", ""] if ppl is None else [f"{ppl:.3f}", f"{ppl / base:.4f}"]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {base:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
