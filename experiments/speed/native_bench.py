"""The decode step's native kernels against the torch ops they replace, side by side in one process.

Attention: SmolLM2-135M's shape (9 query heads, 3 KV heads, head size 64, 30 layers), 1,400 cells per
layer, each layer's cells in its own buffer (as in the cache: nothing stays in the CPU's caches between
layers), torch's SDPA against the native kernel per cell type. Output head: SmolLM2's int8 head (49,152 x
576) times one row, torch's ``_weight_int8pack_mm`` against the native ``int8_gemv``. Rounds interleave
the two; each prints milliseconds per token and the GB/s of what is read, next to the machine's read
bandwidth measured in the same run.

    python experiments/speed/native_bench.py [--cells 1400] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from selfextend.bench.speed import read_bandwidth_gbs
from selfextend.generation.generator import CACHE_DTYPES
from selfextend.native.decode import native_kernels

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
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (49152, 576), dtype=torch.int8, generator=g)
    w_scale, x = (
        (torch.rand(49152, generator=g) / 100).bfloat16(),
        torch.randn(1, 576, generator=g).bfloat16(),
    )
    heads = {
        "torch": lambda: torch.ops.aten._weight_int8pack_mm(x, w, w_scale),
        "native": lambda: kernel.int8_gemv(x, w, w_scale),
    }
    for r in range(args.rounds):
        line = []
        for path, fn in heads.items():
            for _ in range(3):
                fn()
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            ms = (time.perf_counter() - t0) / 50 * 1000
            line.append(f"{path} {ms:.2f} ms ({w.numel() / 1e6 / ms:.1f} GB/s)")
        print(f"int8 head round {r}: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
