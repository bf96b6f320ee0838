"""Where a decode step's time goes, op by op: torch.profiler over 30 SmolLM2 (int4) tokens, eager or compiled.

A cache of 4,096 cells filled with 1,400 prompt tokens (``--cache-type`` f32 by default), then 30 tokens
through the eager :class:`~selfextend.generation.decode.DecodeStep` after 5 untimed ones, plain or with
Self-Extend (``--self-extend``: G=4, W=1024). Prints
the profiler's table by self CPU time: read each kernel's share against the bytes it reads.

    python experiments/decode_profile.py [--self-extend] [--cache-type bf16] [--compile]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from selfextend.generation.compiled import fast_decode_for
from selfextend.generation.generator import CACHE_DTYPES, Generator
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model

FILL, STEPS = 1400, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--self-extend", action="store_true")
    parser.add_argument("--cache-type", choices=list(CACHE_DTYPES), default="f32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="the compiled step (generation.compiled)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model("smollm2-135m", weights="auto")
    if args.self_extend:
        apply_self_extend(model, group_size=4, window=1024)
    cache = ContextShiftCache(model, n_ctx=4096, n_keep=4, dtype=CACHE_DTYPES[args.cache_type])
    gen = Generator(model, cache)
    step = gen.step
    if args.compile:
        fast = fast_decode_for(model)

        def step(token: int, cache: ContextShiftCache) -> object:
            cache.make_room(1)
            return fast(token, cache)

    gen.feed(torch.randint(100, 40000, (FILL,), generator=torch.Generator().manual_seed(0)).tolist())
    for _ in range(5):
        step(5, cache)
    gen.rewind(FILL)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            step(5, cache)
    print(f"{STEPS} tokens; divide the totals by {STEPS} for one token")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
