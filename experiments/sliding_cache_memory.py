"""KV-cache bytes of Gemma 3 270M's context-shift cache: every layer n_ctx cells against sliding layers
bounded to their window (and the kept cells).

Counts the buffers a ContextShiftCache really allocates (float32, batch 1, as generate/ppl run) for a
model built on the meta device from the config (no weights are read), and checks them against
``cache_bytes``, the formula ``selfextend info`` prints.

    python experiments/sliding_cache_memory.py [--model gemma3-270m] [--keep 0]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from selfextend.cache import ContextShiftCache, cache_bytes
from selfextend.models import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--keep", type=int, default=0)
    parser.add_argument("--ctx", type=int, nargs="+", default=[2048, 32768])
    args = parser.parse_args()
    config = load_config(args.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    print(f"{args.model}, float32, batch 1")
    print("| --ctx | --keep | every layer n_ctx cells | sliding layers bounded | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for ctx in args.ctx:
        sizes = []
        for sliding in (False, True):
            cache = ContextShiftCache(
                model, ctx, args.keep, dtype=torch.float32, device="cpu", sliding=sliding
            )
            assert cache.nbytes() == cache_bytes(config, ctx, args.keep, 4, sliding)
            sizes.append(cache.nbytes())
            del cache
        before, after = sizes
        mib = [f"{b / 2**20:,.1f} MiB" for b in sizes]
        print(f"| {ctx:,} | {args.keep} | {mib[0]} | {mib[1]} | {before / after:.2f}x |")


if __name__ == "__main__":
    main()
