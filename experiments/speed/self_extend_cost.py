"""What Self-Extend adds to a decode token, plain and Self-Extend timed in turn in one process.

The model (SmolLM2 by default, as ``generate`` loads it; ``--model`` also takes a GGUF file) decodes through
the direct step over a cache of ``--ctx`` cells (bf16 by default, as ``generate``'s) holding ``--fill``
prompt tokens, ``--tokens`` tokens per timing, rewound to the prompt after each; every round times plain
attention, then the same cells under Self-Extend ``-g``/``-w`` (the keys more than W back read at grouped
positions: 376 of them at the defaults), and prints the ratio of that round, of the mean times and of the
tokens' median times (what to read on a shared machine). The CPU's name and the load average are printed
with the rounds: the ratio is what to compare across machines and loads.

    python experiments/speed/self_extend_cost.py [--model gemma3-270m] [--rounds 4]
    python experiments/speed/self_extend_cost.py --model qwen2.5-1.5b-Q4_K_M.gguf -w 256 --fill 1024 \\
        --ctx 2048 --tokens 60
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from decode_paths import FILL, filled, load, step_fn

from selfextend import self_extend
from selfextend.generation.generator import Generator


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's, else what the platform says)."""
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def milliseconds(fn: Callable[[Generator], object], gen: Generator, n: int, fill: int) -> tuple[float, float]:
    """(mean, median) milliseconds per token of ``n`` tokens through ``fn`` after 5 untimed ones, from
    ``fill`` cached tokens (rewound to them before and after); the median is the one to read on a shared
    machine, where a token the scheduler preempted weighs on the mean alone."""
    for _ in range(5):
        fn(gen)
    gen.rewind(fill)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(gen)
        times.append(time.perf_counter() - t0)
    gen.rewind(fill)
    return statistics.mean(times) * 1000, statistics.median(times) * 1000


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as uptime prints them."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a shipped model's name or a GGUF file")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-type", default="bf16", choices=["f32", "bf16", "f16"])
    parser.add_argument("-g", "--group-size", type=int, default=4, help="Self-Extend group size G")
    parser.add_argument("-w", "--window", type=int, default=1024, help="Self-Extend neighbor window W")
    parser.add_argument("--fill", type=int, default=FILL, help="prompt tokens in the cache before timing")
    parser.add_argument("--ctx", type=int, default=4096, help="cache cells")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per timing")
    args = parser.parse_args()
    if min(args.rounds, args.threads, args.fill, args.tokens) < 1 or args.ctx < args.fill + args.tokens + 5:
        parser.error("--rounds, --threads, --fill, --tokens at least 1; --ctx above --fill + --tokens + 5")
    model = load(args.model, args.threads, self_extend=False)
    gen = filled(model, args.cache_type, args.fill, args.ctx)
    fn = step_fn(model, "direct")
    fn(gen)
    gen.rewind(args.fill)
    grouped_keys = max(0, args.fill - args.window + 1)
    print(
        f"{cpu_name()}, {args.threads} threads; {args.model}, {args.fill} of {args.ctx} {args.cache_type} "
        f"cells, G={args.group_size} W={args.window} ({grouped_keys} keys grouped at the first token)",
        flush=True,
    )
    ratios: dict[str, list[float]] = {"mean": [], "median": []}
    for r in range(args.rounds):
        plain = milliseconds(fn, gen, args.tokens, args.fill)
        with self_extend(model, group_size=args.group_size, window=args.window):
            grouped = milliseconds(fn, gen, args.tokens, args.fill)
        for k, (a, b) in zip(ratios, zip(plain, grouped, strict=True), strict=True):
            ratios[k].append(b / a)
        print(
            f"round {r}: plain {plain[0]:.2f} ms, Self-Extend {grouped[0]:.2f} ms per token, "
            f"{ratios['mean'][-1]:.3f}x (per-token medians {plain[1]:.2f}, {grouped[1]:.2f} ms: "
            f"{ratios['median'][-1]:.3f}x; load average {load_average()})",
            flush=True,
        )
    for k, values in ratios.items():
        values.sort()
        print(
            f"Self-Extend / plain ({k}s): median {values[len(values) // 2]:.3f}x, "
            f"range {values[0]:.3f}-{values[-1]:.3f}x"
        )


if __name__ == "__main__":
    main()
