"""The decode step's native kernels against the torch ops they replace, side by side in one process.

Attention: a model's shape (``--shape H,HKV,D,LAYERS``; default SmolLM2-135M's 9 query heads, 3 KV heads,
head size 64, 30 layers), ``--cells`` cells per layer, each layer's cells in its own buffer (as in the
cache: nothing stays in the CPU's caches between layers), torch's SDPA against the native kernel per cell
type. Output head: SmolLM2's int8 head (49,152 x 576) times one row, torch's ``_weight_int8pack_mm``
against the native ``int8_gemv``. Rounds interleave the paths; each prints milliseconds per token and the
GB/s of what is read, next to the machine's read bandwidth measured in the same run.

``--against DECODE_C``: the attention of another ``decode.c`` too (an earlier commit's, to measure a
change), in the same rounds, and its time over ours per round; ``--flags``: compiler flags for every build
(``-mno-avx512f``: as an AVX2-only CPU runs it). ``--cache-types``: which cell types (default all).

    python experiments/speed/native_bench.py [--cells 1400] [--rounds 3] [--threads 2]
    git show 2169e2a~1:selfextend/native/decode.c > /tmp/decode_before.c
    python experiments/speed/native_bench.py --shape 12,2,128,28 --cells 1088,4096 --cache-types bf16 \
        --against /tmp/decode_before.c --flags=-mno-avx512f --rounds 5 --no-sdpa --no-head
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from selfextend.bench.speed import read_bandwidth_gbs
from selfextend.core.paths import cache_root
from selfextend.generation.settings import CACHE_DTYPES
from selfextend.native.build import build
from selfextend.native.decode import SOURCE, NativeKernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="1400", help="cells per layer, e.g. 1088,4096")
    parser.add_argument("--shape", default="9,3,64,30", help="query heads, KV heads, head size, layers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against", type=Path, help="another decode.c, its attention timed beside ours")
    parser.add_argument("--flags", default="", help="compiler flags added to every build, e.g. -mno-avx512f")
    parser.add_argument("--cache-types", default=",".join(CACHE_DTYPES), help="cell types, e.g. bf16")
    parser.add_argument("--no-sdpa", action="store_true", help="leave torch's SDPA out")
    parser.add_argument("--no-head", action="store_true", help="leave the int8 head out")
    args = parser.parse_args()
    try:
        h, hkv, d, n_layers = (int(x) for x in args.shape.split(","))
        cells = [int(c) for c in args.cells.split(",")]
    except ValueError:
        parser.error(
            f"--shape takes four integers H,HKV,D,LAYERS and --cells integers, got {args.shape!r}, "
            f"{args.cells!r}"
        )
    types = args.cache_types.split(",")
    if min(h, hkv, d, n_layers, *cells) < 1 or h % hkv or set(types) - set(CACHE_DTYPES):
        parser.error(
            f"sizes must be positive with H a multiple of HKV, cell types among {', '.join(CACHE_DTYPES)}"
        )
    torch.set_num_threads(args.threads)
    flags = tuple(args.flags.split())
    sources, theirs = {"kernel": (SOURCE, "native")}, None
    if args.against is not None:
        theirs = f"against ({args.against.name})"
        sources[theirs] = (args.against, "native-against")
    try:
        kernels = {
            label: NativeKernels(build(cache_root() / "kernels", source, name, flags))
            for label, (source, name) in sources.items()
        }
    except (RuntimeError, OSError) as e:
        raise SystemExit(f"error: the attention kernel could not be built here: {e}") from None
    kernel = kernels["kernel"]
    scale = d**-0.5
    print(f"machine read bandwidth: {read_bandwidth_gbs():.1f} GB/s; shape {args.shape}, {n_layers} layers")
    paths = (
        {}
        if args.no_sdpa
        else {
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(
                q.to(k.dtype), k, v, scale=scale, enable_gqa=True
            )
        }
    )
    for label, kern in kernels.items():
        paths[label] = lambda q, k, v, kern=kern: kern(q, k, v, scale)
    for n in cells:
        for name in types:
            dtype = CACHE_DTYPES[name]
            g = torch.Generator().manual_seed(0)
            layers = [
                [torch.randn(1, hkv, 2 * n, d, generator=g).to(dtype)[..., :n, :] for _ in "kv"]
                for _ in range(n_layers)
            ]
            q = torch.randn(1, h, 1, d, generator=g)
            mb = n_layers * 2 * hkv * n * d * dtype.itemsize / 1e6
            for r in range(args.rounds):
                line, ms_of = [], {}
                order = list(paths.items()) if r % 2 == 0 else list(paths.items())[::-1]
                for path, fn in order:
                    for _ in range(3):
                        [fn(q, k, v) for k, v in layers]
                    t0 = time.perf_counter()
                    for _ in range(20):
                        [fn(q, k, v) for k, v in layers]
                    ms_of[path] = ms = (time.perf_counter() - t0) / 20 * 1000
                    line.append(f"{path} {ms:.2f} ms ({mb / ms:.1f} GB/s)")
                if theirs is not None:
                    line.append(f"ours/against {ms_of['kernel'] / ms_of[theirs]:.3f}")
                print(f"{name} {n} cells round {r}: " + ", ".join(line), flush=True)
    if args.no_head:
        return
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
