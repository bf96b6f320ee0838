"""KV-cache bytes of Gemma 3 270M's context-shift cache: every layer n_ctx cells against sliding layers
bounded to their window (and the kept cells).

Counts the buffers a ContextShiftCache really allocates (float32, batch 1, as generate/ppl run) for a
model built on the meta device from the config (no weights are read), and checks them against
``cache_bytes``, the formula ``selfextend info`` prints. With ``--rss``, also the peak RSS (VmHWM) of a
fresh process per layout that loads the model (int8 weights, as ``generate``), writes a 600-token
prompt in 512-token pieces and decodes 16 tokens.

    python experiments/memory/sliding_cache_memory.py [--model gemma3-270m] [--keep 0] [--rss]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from selfextend.kv.cache import ContextShiftCache, cache_bytes
from selfextend.models import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--keep", type=int, default=0)
    parser.add_argument("--ctx", type=int, nargs="+", default=[2048, 32768])
    parser.add_argument(
        "--rss", action="store_true", help="also the peak RSS of a short generation per layout"
    )
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)  # (ctx, sliding): one run
    args = parser.parse_args()
    if args.child:
        return child(args.model, args.child[0], args.keep, bool(args.child[1]))
    config = load_config(args.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    print(f"{args.model}, float32, batch 1")
    rss = " peak RSS, all cells | peak RSS, bounded |" if args.rss else ""
    print(f"| --ctx | --keep | every layer n_ctx cells | sliding layers bounded |{rss} buffers ratio |")
    print("|---:|---:|---:|---:|" + "---:|" * (3 if args.rss else 1))
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
        if args.rss:
            mib += [f"{peak_rss(args.model, ctx, args.keep, sliding):,.0f} MiB" for sliding in (False, True)]
        print(f"| {ctx:,} | {args.keep} | {' | '.join(mib)} | {before / after:.2f}x |")


def peak_rss(model: str, ctx: int, keep: int, sliding: bool) -> float:
    """VmHWM (MiB) of a fresh process running :func:`child`."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model", model, "--keep", str(keep)]
    out = subprocess.run(
        [*cmd, "--child", str(ctx), str(int(sliding))], capture_output=True, text=True, check=True
    )
    return float(re.search(r"peak_rss_mib=([\d.]+)", out.stdout).group(1))


def child(model_name: str, ctx: int, keep: int, sliding: bool) -> None:
    from selfextend.evaluation.corpus import default_books
    from selfextend.generation.generator import Generator
    from selfextend.models import load_model

    model, tokenizer = load_model(model_name, weights="int8")
    ids = tokenizer(default_books()["sherlock-holmes"][:8000]).input_ids[:600]
    with torch.inference_mode():
        gen = Generator(model, ContextShiftCache(model, ctx, keep, sliding=sliding))
        logits = gen.feed(ids, chunk=512)
        for _ in range(16):
            logits = gen.feed([int(logits.argmax())])
    kib = int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))
    print(f"peak_rss_mib={kib / 1024:.1f}")


if __name__ == "__main__":
    main()
