"""What Self-Extend adds to a decode token, plain and Self-Extend timed in turn in one process.

The model (SmolLM2 int4 by default, as ``generate`` loads it) decodes through the direct step over a cache of
``decode_paths.FILL`` (1,400) prompt tokens in bf16 cells (the default), 100 tokens per timing, rewound to the
prompt after each; every round times plain attention, then the same cells under Self-Extend G=4, W=1024
(the keys more than W back read at grouped positions: 376 of them at this fill), and prints the ratio.

    python experiments/speed/self_extend_cost.py [--model gemma3-270m] [--rounds 4]
"""

from __future__ import annotations

import argparse

from decode_paths import FILL, filled, load, milliseconds, step_fn

from selfextend import self_extend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a shipped model's name")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-type", default="bf16", choices=["f32", "bf16", "f16"])
    args = parser.parse_args()
    model = load(args.model, args.threads, self_extend=False)
    gen = filled(model, args.cache_type)
    fn = step_fn(model, "direct")
    fn(gen)
    gen.rewind(FILL)
    ratios = []
    for r in range(args.rounds):
        plain = milliseconds(fn, gen)
        with self_extend(model, group_size=4, window=1024):
            grouped = milliseconds(fn, gen)
        ratios.append(grouped / plain)
        print(f"round {r}: plain {plain:.2f} ms, Self-Extend {grouped:.2f} ms per token, {ratios[-1]:.3f}x")
    ratios.sort()
    median = ratios[len(ratios) // 2]
    print(f"Self-Extend / plain: median {median:.3f}x, range {ratios[0]:.3f}-{ratios[-1]:.3f}x")


if __name__ == "__main__":
    main()
