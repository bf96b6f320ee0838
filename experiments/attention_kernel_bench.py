"""The native decode-attention kernel alone: one query token over a layer's bf16 cells, timed per layer.

Cycles through ``--layers`` layers' cells (30 x 768 KB for SmolLM2 at 1,000 cells: past the L2, as a decode
step reads them) and reports microseconds per layer (the ctypes call included) and the cells' bytes over
that time. To compare two versions of ``native.c``, run the script once per checkout in turn, each with its
own ``PYTHONPATH`` (the kernels are built once per source):

    python experiments/attention_kernel_bench.py --kv-heads 3 --rows 3 --head-dim 64 --cells 1000
    PYTHONPATH=/path/to/other/checkout python experiments/attention_kernel_bench.py ...
"""

from __future__ import annotations

import argparse
import time

import torch

from selfextend.generation.native import native_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--rows", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cells", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("error: the native kernels are not built here (no C compiler?)")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    shape = (1, args.kv_heads, args.cells, args.head_dim)
    cells = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(args.layers)]
    q = torch.randn(1, args.kv_heads * args.rows, 1, args.head_dim)
    scale = args.head_dim**-0.5
    for k, v in cells:  # warm-up
        kernels(q, k, v, scale, checked=True)
    start = time.perf_counter()
    for _ in range(args.repeats):
        for k, v in cells:
            kernels(q, k, v, scale, checked=True)
    per_layer = (time.perf_counter() - start) / args.repeats / args.layers
    read = 2 * args.kv_heads * args.cells * args.head_dim * 2  # keys and values, bf16
    print(
        f"Hkv={args.kv_heads} R={args.rows} D={args.head_dim} cells={args.cells} threads={args.threads}: "
        f"{per_layer * 1e6:.0f} us/layer, {read / per_layer / 1e9:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
