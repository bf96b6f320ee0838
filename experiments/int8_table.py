"""Print int8-weight perplexities next to float32 ones from one JSONL file, with their ratio.

python experiments/int8_table.py experiments/results/int8_quality.jsonl
"""

from __future__ import annotations

import sys

from selfextend.evaluation.results import read_jsonl


def main(path: str) -> None:
    records = read_jsonl(path)
    floats = {(r["doc"], r["method"], r["length"]): r for r in records if "+" not in r["model"]}
    print("| document | method | length | PPL float32 | PPL int8 | int8 / float32 |")
    print("|---|---|---:|---:|---:|---:|")
    for r in records:
        if "+int8" not in r["model"]:
            continue
        base = floats.get((r["doc"], r["method"], r["length"]))
        if base:
            ratio = r["ppl"] / base["ppl"]
            print(
                f"| {r['doc']} | {r['method']} | {r['length']} | {base['ppl']:.3f} | {r['ppl']:.3f} "
                f"| {ratio:.4f} |"
            )


if __name__ == "__main__":
    main(sys.argv[1])
