"""One GGUF block product at a 1B-class shape: the native kernel (``models/quant.c``) against torch's
int4 kernel on the same Q4_K blocks, one row (decode) and a 512-row chunk (prefill), interleaved rounds.

Each prints milliseconds, the GB/s of the blocks read (Q4_K: 144 bytes per 256 weights; torch's int4
packing: its own 4-bit bytes) and GFLOP/s, next to the machine's read bandwidth measured in the same round.
The blocks are random valid Q4_K ones (speed does not depend on the values). Each call takes the next of
``--copies`` copies of the weight, so that they add up to more than the last-level cache and a call reads
from memory as a decode step does (one 9.4 MB weight called again and again stays in a 32 MB L3: its GB/s
were the cache's).

    python experiments/quant_bench.py [--n-in 2048] [--n-out 8192] [--copies 12] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

import numpy as np
import torch

from selfextend.bench.speed import read_bandwidth_gbs
from selfextend.models.quant import quant_kernels
from selfextend.models.quantize import INT4_GROUP, Q4_K, Int4Linear


def q4k_blocks(rows: int, columns: int) -> np.ndarray:
    """Random Q4_K blocks (rows, bytes per row) with small float16 d and dmin."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (rows, columns // 256, 144), dtype=np.uint8)
    raw[..., :4] = rng.uniform(1e-4, 5e-4, (rows, columns // 256, 2)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def seconds(f: Callable[[], object], reps: int) -> float:
    f()
    start = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-in", type=int, default=2048)
    parser.add_argument("--n-out", type=int, default=8192)
    parser.add_argument("--copies", type=int, default=12, help="weights cycled through (past the L3)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = quant_kernels()
    if kernels is None:
        raise SystemExit("the native kernel did not build")
    raw = q4k_blocks(args.n_out, args.n_in)
    blocks, int4 = torch.from_numpy(raw), Int4Linear.from_gguf(Q4_K, raw, args.n_in)
    copies = max(1, args.copies)
    ours_next = itertools.cycle([blocks.clone() for _ in range(copies)]).__next__
    packed = itertools.cycle([(int4.weight_int4.clone(), int4.scales_zeros.clone()) for _ in range(copies)])
    w = int4.weight_int4

    def theirs_call(x: torch.Tensor) -> torch.Tensor:
        weight, scales_zeros = next(packed)
        return torch._weight_int4pack_mm_for_cpu(x, weight, INT4_GROUP, scales_zeros)

    for r in range(args.rounds):
        bandwidth = read_bandwidth_gbs()
        for m, reps in ((1, 50), (512, 3)):
            x = torch.randn(m, args.n_in).bfloat16()
            ours = seconds(lambda x=x: kernels(x, ours_next(), Q4_K, torch.bfloat16), reps)
            theirs = seconds(lambda x=x: theirs_call(x), reps)
            flops = 2 * m * args.n_in * args.n_out / 1e9
            print(
                f"round {r}, {args.threads} threads, m={m}: quant_mm {ours * 1e3:.2f} ms "
                f"({raw.nbytes / ours / 1e9:.2f} GB/s, {flops / ours:.1f} GFLOP/s); int4pack "
                f"{theirs * 1e3:.2f} ms ({w.numel() / theirs / 1e9:.2f} GB/s, {flops / theirs:.1f} GFLOP/s); "
                f"read bandwidth {bandwidth:.2f} GB/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
