"""The fused Self-Extend prefill kernel on a GPU: its speed against flash causal attention, its tiles, and
its error against the reference and the two-pass path. For whoever has a CUDA GPU lent.

One layer of the Llama-3.1-8B shape (32 query / 8 KV heads, head 128, bfloat16), Self-Extend G=32 W=2048
(issue 48's setting). Per length, rounds interleaved, the median of each:

- ``flash``: ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` (the plain model's prefill);
- ``kernel``: the fused kernel alone, the grouped q/k made beforehand;
- ``split``: the grouped pairs through torch's causal kernel (cuDNN's on an H200), then the kernel on the
  neighbor band alone, each row's softmax starting from the grouped result (the grouped q/k made before);
- ``fused``: ``self_extend_attention`` as a model calls it (grouped q/k made, then the split from
  ``attention.SPLIT_ROWS`` rows on);
- ``fused one kernel``: the same with every pair in the one kernel.

Then the kernel's tiles: a few configurations timed at 32k, the fastest named (to make it the default in
``fused_prefill.default_config``). Errors: the fused path against the full-matrix reference at 4k (L x L
in float32), and at 32k against the two-pass path and against the reference for the last 256 rows. Under
90 s on an H200; exits 2 with one line where there is no CUDA GPU or no triton.

    PYTHONPATH=. python experiments/gpu/check_fused_prefill.py [--lengths 4096,32768,65536,131072]

``--dry-run`` (with ``TRITON_INTERPRET=1``): every step of it on the CPU, in Triton's interpreter, on a
small shape (times meaningless), so the script a GPU session starts with is not broken on arrival.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from selfextend.core import attention
from selfextend.core.attention import self_extend_attention, self_extend_attention_reference
from selfextend.core.decode_query import grouped_keys
from selfextend.core.fused_prefill import (
    BlockConfig,
    compute_capability,
    default_config,
    fused_self_extend_prefill,
    interpreting,
)
from selfextend.core.positions import grouped_query_positions
from selfextend.core.rope import rotate

H, HKV, D, GROUP, WINDOW = 32, 8, 128, 32, 2048
DEVICE = "cuda"
REFERENCE_AT, COMPARE_AT = 4096, 32768  # lengths whose errors are measured (the reference's, the 32k ones)
REPS = None  # calls a timing (None: by length)
CONFIGS = [  # tiles whose program compiles for sm_90 without spilling (experiments/gpu/kernel_build.py)
    BlockConfig(128, 64, 8, 3),
    BlockConfig(128, 64, 8, 4),
    BlockConfig(128, 32, 8, 3),
    BlockConfig(128, 32, 8, 2),
    BlockConfig(64, 64, 4, 2),
    BlockConfig(64, 32, 4, 2),
]


def dry_run() -> None:
    """The small shape and the CPU of ``--dry-run`` (Triton's interpreter runs the kernel)."""
    global H, HKV, D, GROUP, WINDOW, DEVICE, REFERENCE_AT, COMPARE_AT, REPS
    H, HKV, D, GROUP, WINDOW, DEVICE = 4, 2, 32, 4, 64, "cpu"
    REFERENCE_AT, COMPARE_AT, REPS = 128, 256, 1  # the interpreter's time grows with the square


def ms(fn: Callable[[], object], reps: int) -> float:
    """Milliseconds per call of ``fn`` (CUDA events around ``reps`` calls; the host's clock off a GPU)."""
    if DEVICE != "cuda":
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) * 1e3 / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def two_pass(*args: object) -> torch.Tensor:
    """``self_extend_attention`` with the fused kernel refused: the two-pass path."""
    applies = attention.fused_prefill_applies
    attention.fused_prefill_applies = lambda *a: False
    try:
        return self_extend_attention(*args)
    finally:
        attention.fused_prefill_applies = applies


def split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_g: torch.Tensor, k_g: torch.Tensor):
    """The grouped pairs through torch's causal kernel, then the kernel on the band."""
    grouped = attention.grouped_pass(q_g, k_g, v, WINDOW, D**-0.5, None, attention.attend_split)
    return fused_self_extend_prefill(q, k, v, None, None, WINDOW, D**-0.5, grouped=grouped)


def one_kernel(*args: object) -> torch.Tensor:
    """``self_extend_attention`` with the split refused: every pair in the one kernel."""
    rows, attention.SPLIT_ROWS = attention.SPLIT_ROWS, 1 << 40
    try:
        return self_extend_attention(*args)
    finally:
        attention.SPLIT_ROWS = rows


def problem(length: int, inv_freq: torch.Tensor) -> dict[str, object]:
    """Random rotated q/k/v of one layer at ``length`` tokens, and the grouped q/k the kernel reads."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shape = (1, H, length, D), (1, HKV, length, D)
    q0 = torch.randn(shape[0], device=DEVICE, generator=gen)
    k0, v = (torch.randn(shape[1], device=DEVICE, generator=gen) for _ in range(2))
    pos = torch.arange(length, device=DEVICE)[None]
    q, k, v = rotate(q0, pos, inv_freq).bfloat16(), rotate(k0, pos, inv_freq).bfloat16(), v.bfloat16()
    n_grouped = length - WINDOW
    k_g = grouped_keys(k[..., :n_grouped, :], pos[:, :n_grouped], GROUP, inv_freq)
    q_g = rotate(q, grouped_query_positions(pos, GROUP, WINDOW) - pos, inv_freq)
    return {"q0": q0, "k0": k0, "q": q, "k": k, "v": v, "pos": pos, "q_g": q_g, "k_g": k_g}


def tiles(p: dict[str, torch.Tensor], reps: int, rounds: int) -> None:
    """Time the kernel with each of CONFIGS and name the fastest."""
    q, k, v, q_g, k_g = (p[n] for n in ("q", "k", "v", "q_g", "k_g"))
    found = {}
    for cfg in CONFIGS:

        def run(cfg: BlockConfig = cfg) -> torch.Tensor:
            return fused_self_extend_prefill(q, k, v, q_g, k_g, WINDOW, D**-0.5, config=cfg)

        try:
            run()
            found[cfg] = min(ms(run, reps) for _ in range(rounds))
        except Exception as e:  # a tile the GPU's shared memory or registers cannot hold
            print(f"  tiles {tuple(cfg)}: refused ({str(e).splitlines()[0][:100]})")
    for cfg, t in found.items():
        print(f"  tiles {tuple(cfg)} (block_m, block_n, warps, stages): {t:.2f} ms")
    best = min(found, key=found.__getitem__)
    default = default_config(D, torch.bfloat16, arch=compute_capability(torch.device(DEVICE)))
    print(f"  fastest tiles {tuple(best)}; default {tuple(default)}")


def one_length(length: int, inv_freq: torch.Tensor, rounds: int) -> None:
    """Speed of each path at ``length`` tokens, rounds interleaved; errors; the tiles at 32k."""
    p = problem(length, inv_freq)
    q, k, v, pos, q_g, k_g = (p[n] for n in ("q", "k", "v", "pos", "q_g", "k_g"))
    se = (q, k, v, pos, GROUP, WINDOW, inv_freq)
    scale = D**-0.5
    paths: dict[str, Callable[[], object]] = {
        "flash": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True
        ),
        "kernel": lambda: fused_self_extend_prefill(q, k, v, q_g, k_g, WINDOW, scale),
        "split": lambda: split(q, k, v, q_g, k_g),
        "fused": lambda: self_extend_attention(*se),
        "fused one kernel": lambda: one_kernel(*se),
    }
    reps = REPS or max(1, min(20, int(5 * (32768 / length) ** 2)))  # about 5 flash calls' time at 32k
    times: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()  # compile, warm
    for _ in range(rounds):
        for name, fn in paths.items():
            times[name].append(ms(fn, reps))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{length:>6} tokens: "
        + ", ".join(f"{n} {t:.2f} ms ({t / med['flash']:.2f}x)" for n, t in med.items())
    )
    fused = self_extend_attention(*se).float()
    if length <= REFERENCE_AT:
        ref = self_extend_attention_reference(p["q0"], p["k0"], v.float(), pos, pos, GROUP, WINDOW, inv_freq)
        print(f"{length:>6} tokens: fused vs reference (float32) max abs {(fused - ref).abs().max():.2e}")
        alone = (one_kernel(*se).float() - ref).abs().max()
        print(f"{length:>6} tokens: fused one kernel vs reference (float32) max abs {alone:.2e}")
    elif length == COMPARE_AT:
        diff = (fused - two_pass(*se).float()).abs().max()
        print(f"{length:>6} tokens: fused vs two-pass max abs {diff:.2e}")
        last = min(256, length // 2)  # the reference's scores for the last rows only (each against all keys)
        ref = self_extend_attention_reference(
            p["q0"][..., -last:, :], p["k0"], v.float(), pos[:, -last:], pos, GROUP, WINDOW, inv_freq
        )
        worst = (fused[..., -last:, :] - ref).abs().max()
        print(f"{length:>6} tokens: fused vs reference (float32), last {last} rows: max abs {worst:.2e}")
        rows = length // 4  # a chunk of a prefill onto a cache: the split's grouped pass in two calls
        chunk = self_extend_attention(q[..., -rows:, :], k, v, pos[:, -rows:], GROUP, WINDOW, inv_freq)
        worst = (chunk.float() - fused[..., -rows:, :]).abs().max()
        print(f"{length:>6} tokens: its last {rows} rows as a chunk vs whole: max abs {worst:.2e}")
        tiles(p, reps, rounds)


def past_int32(length: int = 4160 * 128, device: str = DEVICE) -> dict[str, object]:
    """Rows whose offsets from q's start pass 2**31 elements (transformers' (B, L, H, D) layout at H * D =
    4,096: from 524,288 tokens on), where the kernel's int32 offsets wrapped before it took each block's in
    64 bits: one head of a 532,480-token layer (its row stride that of 32 heads; 7 GB in all), its last 128
    rows against the same rows computed as a short query block (small offsets, the same tiles): equal.
    Run last (check.py): an out-of-bounds read would leave the GPU unusable for what follows."""
    gen = torch.Generator(device=device).manual_seed(1)  # (length: a multiple of every BLOCK_M)
    full = torch.randn(1, length, H, D, device=device, dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(2, 1, length, HKV, D, device=device, dtype=torch.bfloat16, generator=gen)
    q = full[:, :, :1].transpose(1, 2)  # (1, 1, L, D): row stride 4,096
    k, v = (x[:, :, :1].transpose(1, 2) for x in kv)  # row stride 1,024
    k_g = torch.randn(1, 1, length - WINDOW, D, device=device, dtype=torch.bfloat16, generator=gen)
    big = fused_self_extend_prefill(q, k, v, q, k_g, WINDOW, D**-0.5)[:, :, -128:]
    small = fused_self_extend_prefill(q[:, :, -128:], k, v, q[:, :, -128:], k_g, WINDOW, D**-0.5)
    return {
        "tokens": length,
        "max_abs_difference": float((big.float() - small.float()).abs().max()),
        "equal": bool(torch.equal(big, small)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,32768,65536,131072")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU in Triton's interpreter, small")
    args = parser.parse_args()
    if importlib.util.find_spec("triton") is None:
        print("check_fused_prefill: triton is not installed", file=sys.stderr)
        return 2
    if args.dry_run:
        if not interpreting():
            print("check_fused_prefill: --dry-run needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        dry_run()
        args.lengths, args.rounds = f"{REFERENCE_AT},{COMPARE_AT}", 1
    elif not torch.cuda.is_available():
        print("check_fused_prefill: no CUDA GPU here", file=sys.stderr)
        return 2
    import triton

    t0 = time.perf_counter()
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run: Triton's interpreter)"
    print(f"{where}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"one layer: {H} q / {HKV} kv heads, head {D}, bfloat16, Self-Extend G={GROUP} W={WINDOW}")
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    for length in (int(n) for n in args.lengths.split(",")):
        if time.perf_counter() - t0 > 75 and DEVICE == "cuda":
            print(f"stopping before {length} tokens: past 75 s")
            break
        one_length(length, inv_freq, args.rounds)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    print(f"peak GPU memory {peak:.1f} GiB, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
