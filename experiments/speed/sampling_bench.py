"""Milliseconds per sampled token: the whole chain over the vocabulary against the draw among the top-k.

``generate``'s default sampling (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) through transformers'
processors over the whole vocabulary (top-p and min-p each sort it) against :func:`sample`, which runs the
filters after top-k on its candidates only (the same distribution: ``tests/test_generate.py``). Random
logits of SmolLM2's and Gemma 3's vocabulary sizes; rounds interleave the two, 200 draws each.

    python experiments/speed/sampling_bench.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from selfextend.generation.sampling import SamplingParams, distribution, sample

VOCABS = {"SmolLM2": 49152, "Gemma 3": 262144}
DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


def whole(logits: torch.Tensor, recent: torch.Tensor, g: torch.Generator) -> int:
    """The draw from the whole chain's distribution over the vocabulary."""
    return int(torch.multinomial(distribution(logits, DEFAULTS, recent), 1, generator=g))


def candidates(logits: torch.Tensor, recent: torch.Tensor, g: torch.Generator) -> int:
    """The draw as ``generate`` makes it."""
    return sample(logits, DEFAULTS, recent, g)


def milliseconds(fn: Callable[..., int], logits: torch.Tensor, recent: torch.Tensor, n: int = 200) -> float:
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(logits, recent, g)
    return (time.perf_counter() - t0) / n * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name, vocab in VOCABS.items():
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 4
        recent = torch.randint(0, vocab, (64,))
        for r in range(args.rounds):
            a, b = milliseconds(whole, logits, recent), milliseconds(candidates, logits, recent)
            print(f"{name} ({vocab}) round {r}: whole chain {a:.3f} ms, candidates {b:.3f} ms, {a / b:.1f}x")


if __name__ == "__main__":
    main()
