"""Gemma 3 270M (int4 from its GGUF), greedy decoding through a 2048-token shift cache: single tokens through
the model's forward against the compiled step's code run eagerly (what ``Generator`` picks for a model the
direct DecodeStep does not serve), plain and with Self-Extend (G=4, W=1024), rounds interleaved.

    python experiments/eager_step_gemma.py [--model gemma3-270m] [--rounds 3] [--tokens 150]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from selfextend.generation.generator import Generator
from selfextend.hf.patch import apply_self_extend, remove_self_extend
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model


def rate(model: torch.nn.Module, prompt: list[int], eager_step: bool, extend: bool, tokens: int) -> float:
    """Tokens/s of ``tokens`` greedy tokens after ``prompt`` (the first 3 untimed)."""
    if extend:
        apply_self_extend(model, 4, 1024)
    try:
        gen = Generator(model, ContextShiftCache(model, n_ctx=2048, n_keep=4), direct_decode=eager_step)
        for _ in gen.decode(gen.feed(prompt), 3):
            pass
        t0 = time.perf_counter()
        for _ in gen.decode(gen.last_logits, tokens):
            pass
        return tokens / (time.perf_counter() - t0)
    finally:
        if extend:
            remove_self_extend(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, weights="auto")
    prompt = torch.randint(100, 40000, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    ratios: dict[str, list[float]] = {"plain": [], "self-extend": []}
    for r in range(args.rounds):
        for name, extend in (("plain", False), ("self-extend", True)):
            forward = rate(model, prompt, False, extend, args.tokens)
            eager = rate(model, prompt, True, extend, args.tokens)
            ratios[name].append(eager / forward)
            print(
                f"round {r} {name}: forward {forward:.2f} tok/s, eager step {eager:.2f} tok/s, "
                f"{eager / forward:.3f}x (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    for name, values in ratios.items():
        print(
            f"{name}: eager step / forward, median {statistics.median(values):.3f}x over {len(values)} rounds"
        )


if __name__ == "__main__":
    main()
