"""The fused decode attention kernels on a GPU: one query token over one layer's cells, against the decode
step's tensor ops (``attend`` with the kernels refused) and SDPA's plain decode. For whoever has a CUDA GPU.

One layer of the Llama-3.1-8B shape (32 query / 8 KV heads, head 128, bfloat16 cells), plain and
Self-Extend G=32 W=2048 (issue 48's setting), at 8k and 32k cells, and 8k cells in use of 32k (the rest
holding stale positions, read no further than the last in use, as the CUDA-graph step leaves them). Each
path is captured as a CUDA graph (as the decode step is) and replayed; rounds interleaved, the median of
each, in ms and in GB/s of the cells' keys and values in use:

- ``fused``: ``attend`` as the step calls it (the grouped query rotated, then the kernels reading the
  grouped keys the cache keeps);
- ``attend``: ``attend`` with the kernels refused (the tensor ops before them);
- ``sdpa``: ``scaled_dot_product_attention(enable_gqa=True)`` over the cells in use, no mask (plain decode's
  floor; the same for both settings);
- ``fused, keys rotated`` (Self-Extend): the kernels rotating each grouped key by its table row every
  step (what a layer whose cache keeps no grouped keys takes), against ``fused`` reading the stored ones.

Then the kernels' tiles timed at 32k cells with Self-Extend, the fastest named (to make it the default in
``fused_decode.default_config``), and the fused path's largest difference from ``attend``'s tensor ops.
Under a minute on an H200; says it skips and exits 0 where there is no CUDA GPU or no triton.

    PYTHONPATH=. python experiments/gpu/check_fused_decode.py [--rounds 5]

``--dry-run`` (with ``TRITON_INTERPRET=1``): every step of it on the CPU, in Triton's interpreter, on a
small shape, uncaptured (times meaningless), so the script a GPU session starts with is not broken on arrival.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from selfextend.core.decode_query import grouped_keys
from selfextend.core.fused_decode import DecodeConfig, default_config, fused_decode_attention
from selfextend.core.fused_prefill import interpreting
from selfextend.generation.graphed import cuda_graph
from selfextend.generation.step_attention import GroupedRotations, attend

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_fused_prefill  # noqa: E402  (its ms: CUDA events around calls, one way of timing)

H, HKV, D, GROUP, WINDOW = 32, 8, 128, 32, 2048
DEVICE = "cuda"
SETTINGS = [(8192, 8192), (32768, 32768), (32768, 8192)]  # (cells, cells in use)
TILES_AT, REPS = 32768, 50  # the cells whose tiles are timed (Self-Extend, all in use); calls a timing
# (block_n, split, warps, stages) whose program compiles for sm_90 without spilling (kernel_build.py)
CONFIGS = [
    DecodeConfig(64, 512, 4, 3),
    DecodeConfig(64, 512, 4, 2),
    DecodeConfig(64, 1024, 4, 3),
    DecodeConfig(64, 2048, 4, 3),
    DecodeConfig(64, 256, 4, 3),
    DecodeConfig(32, 512, 4, 3),
    DecodeConfig(64, 512, 8, 3),
    DecodeConfig(32, 1024, 4, 3),
    DecodeConfig(32, 256, 4, 3),
    DecodeConfig(32, 512, 4, 4),
    DecodeConfig(32, 512, 4, 2),
    DecodeConfig(16, 512, 4, 3),
    DecodeConfig(32, 512, 2, 3),
]


def dry_run() -> None:
    """The small shape and the CPU of ``--dry-run`` (Triton's interpreter runs the kernels)."""
    global H, HKV, D, GROUP, WINDOW, DEVICE, SETTINGS, TILES_AT, REPS
    H, HKV, D, GROUP, WINDOW, DEVICE = 4, 2, 32, 4, 64, "cpu"
    SETTINGS, TILES_AT, REPS = [(256, 256), (512, 512), (512, 256)], 512, 1
    check_fused_prefill.dry_run()  # its ms() times on the host


def ms(fn: Callable[[], object], reps: int) -> float:
    return check_fused_prefill.ms(fn, reps)


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured as a CUDA graph as the decode step is (``cuda_graph``: warm-up runs first), or
    ``fn`` itself where capture fails (or off a GPU)."""
    if DEVICE != "cuda":
        return fn
    try:
        graph, _ = cuda_graph(fn)
    except RuntimeError as e:
        print(f"  not captured, timed eagerly: {str(e).splitlines()[0][:100]}")
        return fn
    return graph.replay


def problem(cells: int, used: int, self_extend: bool, inv_freq: torch.Tensor) -> tuple:
    """``attend``'s arguments for one layer: random bf16 cells, the query at the last cell in use; with
    Self-Extend, also the cells' grouped keys as the cache keeps them (what the captured step reads)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, H, 1, D, device=DEVICE, generator=gen).bfloat16()
    k, v = (torch.randn(1, HKV, cells, D, device=DEVICE, generator=gen).bfloat16() for _ in range(2))
    positions = torch.arange(cells, device=DEVICE)
    positions[used:] = torch.arange(cells - used, device=DEVICE)  # stale: visible, were they read
    pos = torch.tensor([used - 1], device=DEVICE)
    params = SimpleNamespace(group_size=GROUP, window=WINDOW, inv_freq=inv_freq)
    grouped = GroupedRotations.build(cells, params) if self_extend else None
    stored = grouped_keys(k, positions, GROUP, inv_freq) if self_extend else None
    return (q, k, v, positions, pos, D**-0.5, None, grouped), stored, pos.clone()


def tiles(args: tuple, stored: torch.Tensor, last: torch.Tensor, gb: float, rounds: int) -> None:
    """Time the kernels alone (the grouped keys stored, as the captured step reads them) with each of
    CONFIGS and name the fastest."""
    q, k, v, positions, pos, scale, _, grouped = args
    q_g = grouped.query_at(pos).apply(q.float())
    found = {}
    for cfg in CONFIGS:

        def run(cfg: DecodeConfig = cfg) -> torch.Tensor:
            extra = (q_g, grouped.keys, grouped.window)
            return fused_decode_attention(
                q, k, v, positions, pos, scale, None, *extra, config=cfg, stored=stored, last=last
            )

        try:
            fn = graphed(run)
            found[cfg] = min(ms(fn, REPS) for _ in range(rounds))
        except Exception as e:  # a tile the GPU's registers or shared memory cannot hold
            print(f"  tiles {tuple(cfg)}: refused ({str(e).splitlines()[0][:100]})")
    for cfg, t in found.items():
        print(f"  tiles {tuple(cfg)} (block_n, split, warps, stages): {t:.3f} ms, {gb / t:.0f} GB/s")
    best = min(found, key=found.__getitem__)
    default = default_config(k.shape[2], HKV, D, q.device)
    print(f"  fastest tiles {tuple(best)}; default {tuple(default)}")


def one_setting(cells: int, used: int, self_extend: bool, inv_freq: torch.Tensor, rounds: int) -> None:
    """Each path's speed for one setting, rounds interleaved; the fused path's error; tiles at 32k SE."""
    args, stored, last = problem(cells, used, self_extend, inv_freq)
    q, k, v = args[:3]
    k_used, v_used = k[:, :, :used], v[:, :, :used]
    gb = 2 * k_used.numel() * k.element_size() / 1e6  # MB of keys and values in use: MB / ms = GB/s
    paths: dict[str, Callable[[], object]] = {
        "fused": lambda: attend(*args, stored=stored, last=last),
        "attend": lambda: attend(*args, fused=False, stored=stored, last=last),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k_used, v_used, scale=D**-0.5, enable_gqa=True),
    }
    if stored is not None:  # the grouped keys rotated in the kernel each step instead (a cache keeping none)
        paths["fused, keys rotated"] = lambda: attend(*args, last=last)
    replay = {name: graphed(fn) for name, fn in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in replay.items():
            times[name].append(ms(fn, REPS))
    med = {name: statistics.median(t) for name, t in times.items()}
    kind = f"SE G={GROUP} W={WINDOW}" if self_extend else "plain"
    print(
        f"{cells:>6} cells ({used} in use), {kind}: "
        + ", ".join(f"{n} {t:.3f} ms ({gb / t:.0f} GB/s)" for n, t in med.items())
    )
    want = attend(*args, fused=False, stored=stored, last=last)
    diff = (attend(*args, stored=stored, last=last) - want).abs().max()
    print(f"  fused vs tensor ops: max abs {diff:.2e} (the output's largest {want.abs().max():.2f})")
    if self_extend and cells == used == TILES_AT:
        tiles(args, stored, last, gb, rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU in Triton's interpreter, small")
    args = parser.parse_args()
    if importlib.util.find_spec("triton") is None:
        print("check_fused_decode: triton is not installed, skipped")
        return 0
    if args.dry_run:
        if not interpreting():
            print("check_fused_decode: --dry-run needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        dry_run()
        args.rounds = 1
    elif not torch.cuda.is_available():
        print("check_fused_decode: no CUDA GPU here, skipped")
        return 0
    import triton

    t0 = time.perf_counter()
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run: Triton's interpreter)"
    print(f"{where}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"one layer's decode attention: {H} q / {HKV} kv heads, head {D}, bfloat16 cells")
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    with torch.no_grad():
        for cells, used in SETTINGS:
            for self_extend in (False, True):
                one_setting(cells, used, self_extend, inv_freq, args.rounds)
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    print(f"peak GPU memory {peak:.1f} GiB, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
