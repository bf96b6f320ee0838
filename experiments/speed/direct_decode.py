"""Endless generation through the model's forward against the direct decode step, side by side.

Four generators on the default model with int8 weights, each with its own 2048-token
context-shift cache and the same 1024-token prompt: plain attention and Self-Extend (G=4,
W=1024), each decoded through transformers' forward and through ``DecodeStep``. They take
turns in blocks of 50 greedy tokens, so machine noise hits all alike.

    python experiments/speed/direct_decode.py [--tokens 1000] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch

from selfextend.generation.generator import Generator
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model
from selfextend.models.quantize import quantize_int8

BLOCK = 50
OUT = Path(__file__).parent / "results" / "direct_decode.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1000, help="greedy tokens per generator")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model()
    quantize_int8(model)
    self_extended = apply_self_extend(copy.deepcopy(model), group_size=4, window=1024)
    prompt = torch.randint(100, 40000, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    gens = {
        f"{name} {path}": Generator(
            m, ContextShiftCache(m, n_ctx=2048, n_keep=4), direct_decode=path == "direct"
        )
        for name, m in (("int8", model), ("int8+selfextend", self_extended))
        for path in ("forward", "direct")
    }
    logits = {name: g.feed(prompt) for name, g in gens.items()}
    seconds = dict.fromkeys(gens, 0.0)
    for _ in range(args.tokens // BLOCK):
        for name, g in gens.items():
            t0 = time.perf_counter()
            out = logits[name]
            for _ in range(BLOCK):
                out = g.feed([int(out.argmax())])
            logits[name] = out
            seconds[name] += time.perf_counter() - t0
    n = args.tokens // BLOCK * BLOCK
    rates = {name: n / s for name, s in seconds.items()}
    for name, rate in rates.items():
        print(f"{name:28s} {rate:6.1f} tokens/s  {1000 / rate:6.2f} ms/token")
    for name in ("int8", "int8+selfextend"):
        print(f"{name}: direct / forward = {rates[name + ' direct'] / rates[name + ' forward']:.2f}x")
    OUT.write_text(
        json.dumps(
            {
                "tokens": n,
                "threads": args.threads,
                "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
                "tokens_per_s": rates,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
