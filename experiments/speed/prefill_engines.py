"""A prefill chunk's block products by the two engines (``models/quant.py: chunk_engine``): ``int8``, the
integer products with the GGUF blocks (``quant_mm``), against ``bf16``, the weight dequantized a tile at a
time to bfloat16 and multiplied by torch (oneDNN: AMX tiles where the CPU has them), rounds interleaved.

Random valid blocks of a 1B-class model's matrices (Llama-3.2-1B: 2048 wide, 8192 for the FFN; speed does
not depend on the values) in the types a Q4_K_M and a Q4_0 file hold, for calls of ``--rows`` activation
rows; prints each engine's milliseconds and GMAC/s and their ratio per round, and whether this CPU has AMX.
Where the bf16 engine pays from is what ``BF16_MIN_ROWS`` says; ``auto`` picks bf16 only where AMX runs.

    python experiments/speed/prefill_engines.py [--rows 16,64,512] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_quant import gguf_blocks  # noqa: E402

from selfextend.models.blocks import BLOCK_KINDS, INTERLEAVED, pack8  # noqa: E402
from selfextend.native.quant import amx_present, quant_kernels  # noqa: E402

SHAPES = {  # (kind, rows, columns): the 1B's FFN up/gate and down in Q4_K / Q6_K, attention out in Q4_0x8
    "Q4_K 8192x2048": (12, 8192, 2048),
    "Q6_K 2048x8192": (14, 2048, 8192),
    "Q4_0x8 2048x2048": (2, 2048, 2048),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,64,512", help="activation rows per call, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    kernels = quant_kernels()
    if kernels is None:
        sys.exit("the quant kernels are not built here (no C compiler?)")
    torch.set_num_threads(args.threads)
    print(f"AMX: {'yes' if amx_present() else 'no'}; {args.threads} threads; ms per call (GMAC/s)")
    for name, (kind, n, k) in SHAPES.items():
        raw = gguf_blocks(kind, n, k)
        blocks, form = torch.from_numpy(raw), kind
        if kind in INTERLEAVED:
            blocks, form = torch.from_numpy(pack8(raw, kind)), INTERLEAVED[kind]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            engines = {
                "int8": lambda x=x, b=blocks, f=form: kernels(x, b, f),
                "bf16": lambda x=x, b=blocks, f=form: kernels.tiled(x, b, f),
            }
            for run in engines.values():  # warm: oneDNN builds its primitive per shape once
                run()
            times: dict[str, list[float]] = {e: [] for e in engines}
            for _ in range(args.rounds):
                for engine, run in engines.items():
                    t0 = time.perf_counter()
                    run()
                    times[engine].append(time.perf_counter() - t0)
            ratios = [a / b for a, b in zip(times["int8"], times["bf16"], strict=True)]
            cells = [
                f"{e} {1e3 * statistics.median(t):7.1f} ms ({m * n * k / statistics.median(t) / 1e9:5.0f})"
                for e, t in times.items()
            ]
            print(
                f"{name:18} {BLOCK_KINDS[kind]:5} rows {m:4}: {'  '.join(cells)}  bf16 / int8 rate: "
                + ", ".join(f"{r:.2f}x" for r in ratios)
            )


if __name__ == "__main__":
    main()
