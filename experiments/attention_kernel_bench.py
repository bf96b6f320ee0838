"""Decode attention over 30 layers of distinct cells: torch's SDPA against the native kernel, per cell type.

SmolLM2-135M's shape (9 query heads, 3 KV heads, head size 64, 30 layers), 1,400 cells per layer, each
layer's cells in its own buffer (as in the cache: nothing stays in the CPU's caches between layers).
Rounds interleave SDPA and the kernel; each prints milliseconds per token (all 30 layers) and the GB/s
of cells read, next to the machine's read bandwidth measured in the same run.

    python experiments/attention_kernel_bench.py [--cells 1400] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from selfextend.bench.speed import read_bandwidth_gbs
from selfextend.generation.generator import CACHE_DTYPES
from selfextend.generation.native import native_kernels

H, HKV, D, LAYERS = 9, 3, 64, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=1400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = native_kernels()
    if kernel is None:
        raise SystemExit("error: the attention kernel could not be built here (no C compiler?)")
    n, scale = args.cells, D**-0.5
    print(f"machine read bandwidth: {read_bandwidth_gbs():.1f} GB/s; {n} cells x {LAYERS} layers")
    paths = {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(
            q.to(k.dtype), k, v, scale=scale, enable_gqa=True
        ),
        "kernel": lambda q, k, v: kernel(q, k, v, scale),
    }
    for name, dtype in CACHE_DTYPES.items():
        g = torch.Generator().manual_seed(0)
        layers = [
            [torch.randn(1, HKV, 2 * n, D, generator=g).to(dtype)[..., :n, :] for _ in "kv"]
            for _ in range(LAYERS)
        ]
        q = torch.randn(1, H, 1, D, generator=g)
        mb = LAYERS * 2 * HKV * n * D * dtype.itemsize / 1e6
        for r in range(args.rounds):
            line = []
            for path, fn in paths.items():
                for _ in range(3):
                    [fn(q, k, v) for k, v in layers]
                t0 = time.perf_counter()
                for _ in range(20):
                    [fn(q, k, v) for k, v in layers]
                ms = (time.perf_counter() - t0) / 20 * 1000
                line.append(f"{path} {ms:.2f} ms ({mb / ms:.1f} GB/s)")
            print(f"{name} round {r}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
