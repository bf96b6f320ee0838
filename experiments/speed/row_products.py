"""One-row (decode) block products read from memory: each GGUF type the kernels compute, as stored and in
its 8-row interleaved form where it has one (``models/blocks.py: pack8``), rounds interleaved.

Random valid blocks of ``--rows`` x ``--columns`` (speed does not depend on the values), enough copies
cycled to add up to past the last-level cache, one bfloat16 activation row per call; prints the GB/s of
the blocks read per form next to the machine's read bandwidth measured in the same round, for 1 and 2
threads. What a decode step's products can reach; what a step reaches is ``selfextend bench``'s GB/s.
``--against SOURCE``: the same products through the kernels built from another ``quant.c`` too (an
earlier commit's, to measure a change), in the same rounds.

    python experiments/speed/row_products.py [--kinds 8,2,12,14] [--rows 49152] [--columns 576] [--rounds 3]
    git show 5a687d9:selfextend/models/quant.c > /tmp/quant_before.c
    python experiments/speed/row_products.py --kinds 12,14 --rows 8192 --columns 2048 \
        --against /tmp/quant_before.c
    python experiments/speed/row_products.py --kinds 12,14 --rows 8192 --columns 2048 --activations 1,2,4,64 \
        --against /tmp/quant_before.c

``--activations``: that many activation rows per call too (the server's batched step of several slots, a
prompt chunk), each count's time per call and multiply-adds per second (GMAC/s) beside its GB/s. ``--flags``:
compiler flags added to every build (``-mno-avx512f``: the AVX2 loops, as a CPU without AVX-512 runs them,
on one that has it; ``$SELFEXTEND_NATIVE_FLAGS`` too); a form an ``--against`` source lacks (the K-quants'
interleaved ones before they existed) is left out of its rows. ``--against`` also takes a folder: an earlier
commit's ``selfextend/native`` (its C files of the names the library has now, this table's generated
header). ``--cpu-time``: rates per second of the process's CPU time, not of the wall clock (on a machine
shared with other work, what the loops do while they run; with one thread), and ``--threads``, ``--calls``
for long calls (many activation rows):

    git archive HEAD selfextend/native | tar -x -C /tmp/before
    python experiments/speed/row_products.py --kinds 12,14 --rows 8960 --columns 1536 --activations 4,512 \
        --threads 1 --calls 4 --cpu-time --flags=-mno-avx512f --against /tmp/before/selfextend/native

``--gguf FILE``: the block tensors of one layer of a real file (``--layer``, default 0) in place of random
blocks of ``--kinds``, each as stored and interleaved, one copy (read from the cache where it fits: a prompt
chunk's rate, not a decode step's from memory):

    python experiments/speed/row_products.py --gguf dev-models/qwen2.5-1.5b-synthetic-Q4_K_M.gguf \
        --activations 512 --threads 1 --calls 2 --cpu-time --flags=-mno-avx512f \
        --against /tmp/before/selfextend/native

    git show 505ff03:selfextend/models/quant.c > /tmp/quant_505ff03.c
    python experiments/speed/row_products.py --kinds 12,14 --rows 8960 --columns 1536 --activations 1 \
        --rounds 3 --against /tmp/quant_505ff03.c --flags=-mno-avx512f
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_quant import gguf_blocks  # noqa: E402

from selfextend.bench.speed import read_bandwidth_gbs  # noqa: E402
from selfextend.core.paths import cache_root  # noqa: E402
from selfextend.models.blocks import BLOCK_KINDS, INTERLEAVED, pack8  # noqa: E402
from selfextend.native.blocktypes import block_shape  # noqa: E402
from selfextend.native.build import Sources, build  # noqa: E402
from selfextend.native.quant import SOURCE, QuantKernels  # noqa: E402


def against_sources(path: Path) -> Path | Sources:
    """The sources ``--against`` names: a C file as it is, or a folder's C files of the names the library
    has now (those it holds), with this table's generated header."""
    if not path.is_dir():
        return path
    files = tuple(path / f.name for f in SOURCE.files if (path / f.name).exists())
    return Sources(files, SOURCE.generated)


def layer_tensors(path: Path, layer: int) -> dict[str, tuple[np.ndarray, int]]:
    """The tensors of layer ``layer`` of GGUF file ``path`` that the kernels hold as blocks: name ->
    ((rows, bytes per row) uint8, GGUF type)."""
    found = {}
    for t in GGUFReader(path).tensors:
        kind = int(t.tensor_type)
        if t.name.startswith(f"blk.{layer}.") and kind in BLOCK_KINDS and len(t.shape) == 2:
            rows = int(t.shape[1])  # gguf's shape is (columns, rows)
            found[t.name.removeprefix(f"blk.{layer}.")] = (
                np.ascontiguousarray(t.data).reshape(rows, -1),
                kind,
            )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kinds", default="8,2,12,14", help="GGUF type numbers (8 Q8_0, 2 Q4_0, 12 Q4_K ...)"
    )
    parser.add_argument("--rows", type=int, default=49152)
    parser.add_argument("--columns", type=int, default=576)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another quant.c, timed beside this one's")
    parser.add_argument(
        "--activations", default="1", help="activation rows per call, e.g. 1,2,4,64 (a batched step, a chunk)"
    )
    parser.add_argument("--flags", default="", help="compiler flags added to every build, e.g. -mno-avx512f")
    parser.add_argument("--threads", default="1,2", help="thread counts, each in turn")
    parser.add_argument("--calls", type=int, default=30, help="timed calls per form and round")
    parser.add_argument("--cpu-time", action="store_true", help="rates per second of CPU time, not wall time")
    parser.add_argument("--gguf", type=Path, help="a GGUF file whose layer's tensors are timed (not --kinds)")
    parser.add_argument("--layer", type=int, default=0, help="which layer of --gguf")
    args = parser.parse_args()
    flags = tuple(args.flags.split())
    clock = time.process_time if args.cpu_time else time.perf_counter
    sources: dict[str, tuple[Path | Sources, str]] = {"": (SOURCE, "quant")}
    if args.against is not None:
        sources[f" ({args.against.name})"] = (against_sources(args.against), "quant-against")
    try:
        builds = {
            label: QuantKernels(build(cache_root() / "kernels", source, name, flags))
            for label, (source, name) in sources.items()
        }
    except (RuntimeError, OSError) as e:
        sys.exit(f"the quant kernels are not built: {e}")
    if args.gguf is not None:
        tensors = layer_tensors(args.gguf, args.layer)
    else:
        kinds = (int(k) for k in args.kinds.split(","))
        tensors = {BLOCK_KINDS[k]: (gguf_blocks(k, args.rows, args.columns), k) for k in kinds}
    forms: dict[str, tuple[list[torch.Tensor], int, int]] = {}  # name -> (copies, type, columns)
    for name, (raw, kind) in tensors.items():
        columns = raw.shape[1] // block_shape(kind)[1] * block_shape(kind)[0]
        copies = 1 if args.gguf is not None else max(2, int(400e6 // raw.size))
        forms[name] = ([torch.from_numpy(raw.copy()) for _ in range(copies)], kind, columns)
        if kind in INTERLEAVED and raw.shape[0] % 8 == 0:
            packed = pack8(raw, kind)
            forms[name + "x8"] = (
                [torch.from_numpy(packed.copy()) for _ in range(copies)],
                INTERLEAVED[kind],
                columns,
            )
    counts = [int(m) for m in args.activations.split(",")]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for r in range(args.rounds):
            rates = []
            for (name, (copies, kind, columns)), m, (label, kernels) in itertools.product(
                forms.items(), counts, builds.items()
            ):
                x = torch.randn(m, columns).bfloat16()
                cycle = itertools.cycle(copies)
                try:
                    kernels(x, copies[0], kind, torch.bfloat16)
                except MemoryError:  # quant_mm's refusal of a type the build lacks
                    continue
                for _ in range(4):
                    kernels(x, next(cycle), kind, torch.bfloat16)
                t0 = clock()
                for _ in range(args.calls):
                    kernels(x, next(cycle), kind, torch.bfloat16)
                seconds = clock() - t0
                macs = m * copies[0].shape[0] * columns * args.calls / seconds / 1e9
                per_call = f" {seconds / args.calls * 1e3:.2f} ms {macs:.1f} GMAC/s"
                shown = f"{name}{label}" if counts == [1] else f"{name} x{m}{label}{per_call}"
                rates.append(f"{shown} {copies[0].numel() * args.calls / seconds / 1e9:.1f}")
            bandwidth = read_bandwidth_gbs()
            print(
                f"{threads} thread(s), round {r}: "
                + ", ".join(rates)
                + f" GB/s; read bandwidth {bandwidth:.1f}"
            )


if __name__ == "__main__":
    main()
