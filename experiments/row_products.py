"""One-row (decode) block products read from memory: each GGUF type the kernels compute, as stored and in
its 8-row interleaved form where it has one (``models/blocks.py: pack8``), rounds interleaved.

Random valid blocks of ``--rows`` x ``--columns`` (speed does not depend on the values), enough copies
cycled to add up to past the last-level cache, one bfloat16 activation row per call; prints the GB/s of
the blocks read per form next to the machine's read bandwidth measured in the same round, for 1 and 2
threads. What a decode step's products can reach; what a step reaches is ``selfextend bench``'s GB/s.
``--against SOURCE``: the same products through the kernels built from another ``quant.c`` too (an
earlier commit's, to measure a change), in the same rounds.

    python experiments/row_products.py [--kinds 8,2,12,14] [--rows 49152] [--columns 576] [--rounds 3]
    git show 5a687d9:selfextend/models/quant.c > /tmp/quant_before.c
    python experiments/row_products.py --kinds 12,14 --rows 8192 --columns 2048 --against /tmp/quant_before.c
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_quant import gguf_blocks  # noqa: E402

from selfextend.bench.speed import read_bandwidth_gbs  # noqa: E402
from selfextend.models.blocks import BLOCK_KINDS, INTERLEAVED, pack8  # noqa: E402
from selfextend.models.build import kernels as build_kernels  # noqa: E402
from selfextend.models.quant import QuantKernels, quant_kernels  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kinds", default="8,2,12,14", help="GGUF type numbers (8 Q8_0, 2 Q4_0, 12 Q4_K ...)"
    )
    parser.add_argument("--rows", type=int, default=49152)
    parser.add_argument("--columns", type=int, default=576)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another quant.c, timed beside this one's")
    args = parser.parse_args()
    builds = {"": quant_kernels()}
    if builds[""] is None:
        sys.exit("the quant kernels are not built here (no C compiler?)")
    if args.against is not None:
        against = build_kernels(args.against, "quant-against", QuantKernels, "{reason}")
        if against is None:
            sys.exit(f"--against {args.against}: not built (the warning above says why)")
        builds[f" ({args.against.name})"] = against
    forms: dict[str, tuple[list[torch.Tensor], int]] = {}
    for kind in (int(k) for k in args.kinds.split(",")):
        raw = gguf_blocks(kind, args.rows, args.columns)
        copies = max(2, int(400e6 // raw.size))
        forms[BLOCK_KINDS[kind]] = ([torch.from_numpy(raw.copy()) for _ in range(copies)], kind)
        if kind in INTERLEAVED and args.rows % 8 == 0:
            packed = pack8(raw, kind)
            forms[BLOCK_KINDS[kind] + "x8"] = (
                [torch.from_numpy(packed.copy()) for _ in range(copies)],
                INTERLEAVED[kind],
            )
    x = torch.randn(1, args.columns).bfloat16()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for r in range(args.rounds):
            rates = []
            for (name, (copies, kind)), (build, kernels) in itertools.product(forms.items(), builds.items()):
                cycle = itertools.cycle(copies)
                for _ in range(4):
                    kernels(x, next(cycle), kind, torch.bfloat16)
                t0 = time.perf_counter()
                for _ in range(30):
                    kernels(x, next(cycle), kind, torch.bfloat16)
                seconds = time.perf_counter() - t0
                rates.append(f"{name}{build} {copies[0].numel() * 30 / seconds / 1e9:.1f}")
            bandwidth = read_bandwidth_gbs()
            print(
                f"{threads} thread(s), round {r}: "
                + ", ".join(rates)
                + f" GB/s; read bandwidth {bandwidth:.1f}"
            )


if __name__ == "__main__":
    main()
