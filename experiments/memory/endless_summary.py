"""Flat memory and rate of an endless run, from the JSON lines ``generate --stats-every 1000`` wrote.

    python experiments/memory/endless_summary.py \
        experiments/memory/results/endless_generation_ctx2048_int8_100000.jsonl

Prints resident memory after 5k tokens and after the last line (and their ratio), and tokens/s over
tokens 5k-10k against the last 5k (each the tokens of the span over the sum of its windows' seconds).
"""

from __future__ import annotations

import json
import sys

from selfextend.evaluation.results import read_jsonl


def span_rate(lines: list[dict], first: int, last: int) -> float:
    """tokens/s over the windows that end in (first, last]."""
    windows = [r for r in lines if first < r["tokens"] <= last]
    steps = [b["tokens"] - a["tokens"] for a, b in zip([{"tokens": first}, *windows], windows, strict=False)]
    seconds = sum(n / r["tokens_per_s"] for n, r in zip(steps, windows, strict=True))
    return sum(steps) / seconds


def main(path: str) -> None:
    lines = sorted(read_jsonl(path), key=lambda r: r["tokens"])
    end = lines[-1]["tokens"]
    if end < 10_000:
        raise SystemExit(f"{path}: the run reached {end} tokens; this summary needs at least 10,000")
    rss = {r["tokens"]: r["rss_mib"] for r in lines}
    at5k = rss[min(rss, key=lambda n: abs(n - 5000))]
    early, late = span_rate(lines, 5000, 10_000), span_rate(lines, end - 5000, end)
    print(
        json.dumps(
            {
                "tokens": end,
                "rss_mib_5k": at5k,
                "rss_mib_end": rss[end],
                "rss_end_over_5k": round(rss[end] / at5k, 4),
                "tokens_per_s_5k_10k": round(early, 2),
                "tokens_per_s_last_5k": round(late, 2),
                "last_5k_over_5k_10k": round(late / early, 4),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
