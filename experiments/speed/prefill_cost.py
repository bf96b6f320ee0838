"""Time and peak memory of one long prefill: plain SDPA against Self-Extend, side by side.

Each run is a fresh process (so no allocator cache from an earlier variant hides a peak);
runs alternate between variants so that machine noise hits both alike. Peak memory is the
process's resident high-water mark (VmHWM), reset after the model is loaded and warmed up,
so it counts the prefill alone; the loaded baseline is reported too.

    python experiments/speed/prefill_cost.py [--tokens 16384] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("plain", "selfextend")


def worker(variant: str, tokens: int, group_size: int, window: int) -> None:
    """One prefill in this process; prints a JSON line."""
    import torch

    import selfextend
    from selfextend.bench.runner import status_kib
    from selfextend.evaluation.corpus import default_books
    from selfextend.models import load_model

    model, tokenizer = load_model("smollm2-135m", dtype=torch.float32)
    text = default_books()["sherlock-holmes"]
    ids = tokenizer(text[: tokens * 8], return_tensors="pt").input_ids[:, :tokens]
    if variant == "selfextend":
        selfextend.apply_self_extend(model, group_size, window)
    with torch.no_grad():
        model(ids[:, :2048], logits_to_keep=1)  # warm-up: lazy inits, thread pools
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
        base = status_kib("VmRSS")
        t0 = time.perf_counter()
        model(ids, logits_to_keep=1)
        seconds = time.perf_counter() - t0
    peak = status_kib("VmHWM")
    print(
        json.dumps(
            {
                "variant": variant,
                "tokens": tokens,
                "seconds": seconds,
                "base_mib": base / 1024,
                "peak_mib": peak / 1024,
                "extra_mib": (peak - base) / 1024,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS / "prefill_cost.json")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.tokens, args.group_size, args.window)
        return

    runs: list[dict] = []
    for rep in range(args.repeats):
        for variant in VARIANTS:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                variant,
                "--tokens",
                str(args.tokens),
                "--group-size",
                str(args.group_size),
                "--window",
                str(args.window),
            ]
            line = (
                subprocess.run(cmd, check=True, capture_output=True, text=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            runs.append(json.loads(line))
            r = runs[-1]
            print(
                f"[{rep}] {variant:10s} {r['seconds']:7.1f} s  peak {r['peak_mib']:7.0f} MiB"
                f"  (prefill adds {r['extra_mib']:6.0f} MiB over {r['base_mib']:.0f})",
                flush=True,
            )

    def summary(variant: str) -> dict:
        rs = [r for r in runs if r["variant"] == variant]
        return {k: statistics.median(r[k] for r in rs) for k in ("seconds", "peak_mib", "extra_mib")}

    plain, se = summary("plain"), summary("selfextend")
    ratios = {k: se[k] / plain[k] for k in plain}
    print(
        f"Self-Extend / plain at {args.tokens} tokens: time {ratios['seconds']:.2f}x, "
        f"peak memory {ratios['peak_mib']:.2f}x, prefill's own memory {ratios['extra_mib']:.2f}x"
    )
    import torch

    record = {
        "tokens": args.tokens,
        "group_size": args.group_size,
        "window": args.window,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "median": {"plain": plain, "selfextend": se},
        "ratios": ratios,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
