"""Where a decode step's time goes, op by op: torch.profiler over 30 tokens (default weights).

A cache of 4,096 cells filled with 1,400 prompt tokens (``--cache-type`` f32 by default), set up as
``decode_paths.py`` does, then 30 tokens through the eager :class:`~selfextend.generation.decode.DecodeStep`
(``--compile``: the compiled step) after 5 untimed ones, plain or with Self-Extend (``--self-extend``: G=4,
W=1024). Prints the profiler's table by self CPU time: read each kernel's share against the bytes it reads.

    python experiments/decode_profile.py [-m MODEL] [--self-extend] [--cache-type bf16] [--compile]
"""

from __future__ import annotations

import argparse

from decode_paths import FILL, filled, load, step_fn
from torch.profiler import ProfilerActivity, profile

from selfextend.generation.generator import CACHE_DTYPES

STEPS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="smollm2-135m", help="an alias, a GGUF or a model folder")
    parser.add_argument("--self-extend", action="store_true")
    parser.add_argument("--cache-type", choices=list(CACHE_DTYPES), default="f32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="the compiled step (generation.compiled)")
    args = parser.parse_args()
    model = load(args.model, args.threads, args.self_extend)
    gen = filled(model, args.cache_type)
    step = step_fn(model, "layer" if args.compile else "direct")
    for _ in range(5):
        step(gen)
    gen.rewind(FILL)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            step(gen)
    print(f"{STEPS} tokens; divide the totals by {STEPS} for one token")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
