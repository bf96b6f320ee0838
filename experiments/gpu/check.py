"""Every GPU check of issue 48 in one run (about 5.5 minutes on an H200; lease.sh runs its sections apart).

1. **parity** (tiny random models, float32): generate through two context shifts (Llama, Qwen3, Gemma 3;
   plain and Self-Extend), greedy and seeded, on ``cuda`` against the CPU; two batched slots against each
   alone; ``ppl``'s scores and ``passkey``'s answers.
2. **cli** (``.gpu/tiny``, made by prepare.sh): ``generate`` (with a shift, with ``-g/-w``, on a GGUF),
   ``chat``, ``passkey``, ``ppl`` and ``serve`` with 2 slots on ``--device cuda`` against ``--device cpu``;
   ``bench`` (every case but llama.cpp's) on ``cuda``, each row naming the GPU.
3. **kernel**: the fused Triton kernels' own checks (Self-Extend prefill, decode attention) where they
   exist: speed against the paths they replace, tiles, errors (in a dry run with
   ``TRITON_INTERPRET=1``, their own dry runs: small, in the interpreter; else skipped).
4. **8b** (a Llama-3.1-8B shape, random bf16 weights): prefill plain against Self-Extend at 16k-128k (to
   64k with ``--short``) with peak memory; our engine's decode ms/token at 8k and 32k cells, plain and
   Self-Extend; then generate through a context shift (plain and Self-Extend), two batched slots, ``ppl``,
   ``passkey`` and two ``chat`` turns through a shift with that shape, against a CPU copy to bfloat16's
   tolerance (``gpu_8b_runs.py``). **8b-cpu** is that comparison with the CPU copy alone (a few minutes of
   the host's time: a short lease takes ``--only kernel,8b,parity``).

    bash experiments/gpu/prepare.sh          # here, once: wheels and the tiny model into .gpu/
    # on the GPU machine (the device tool: carry [".gpu"]):
    bash experiments/gpu/run.sh [--short] [--only parity,cli,kernel,8b,8b-cpu]

Prints one line a check and appends each, as it is made, to ``$OUT/gpu_check.jsonl`` (else
./gpu_check.jsonl) as JSON Lines.
Exits 1 when a parity check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).parent))

SECTIONS = ("parity", "cli", "kernel", "8b", "8b-cpu")  # in the order they run
FAILED: list[str] = []
OUT = Path(os.environ.get("OUT") or ".") / "gpu_check.jsonl"


def report(check: str, ok: bool | None = None, **fields) -> None:
    """One line and one record, appended to :data:`OUT` at once (a run cut off by the device's time limit
    still leaves every check it made); ``ok`` False marks the run failed."""
    record = {"check": check, **({} if ok is None else {"ok": ok}), **fields}
    with OUT.open("a") as f:
        f.write(json.dumps(record) + "\n")
    if ok is False:
        FAILED.append(check)
    mark = "" if ok is None else ("ok   " if ok else "FAIL ")
    print(mark + check + ": " + ", ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--short", action="store_true", help="8b prefill to 64k only (128k: ~35 s more)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the script itself on the CPU: 'cuda' replaced by 'cpu', the 8b section on a small shape "
        "(checks that it runs, measures nothing)",
    )
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        print("error: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    sections = set(args.only.split(","))
    if sections - set(SECTIONS):
        parser.error(
            f"--only: unknown {', '.join(sorted(sections - set(SECTIONS)))} (of {', '.join(SECTIONS)})"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("")  # this run's records only
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    report("machine", gpu=gpu, torch=torch.__version__, cuda=torch.version.cuda)
    t0 = time.perf_counter()
    if "parity" in sections:
        from gpu_parity import parity

        guarded("parity", parity, report, device)
    if "cli" in sections:
        from gpu_cli import cli_checks

        guarded("cli", cli_checks, report, ROOT, device)
    if "kernel" in sections:  # before the 8B shape, whose CPU runs take the longest: tiles are timed first
        kernel_check(device)
    if sections & {"8b", "8b-cpu"}:
        from gpu_8b import eight_b

        eight_b(report, gpu, not args.short, device, guarded, "8b" in sections, "8b-cpu" in sections)
    if "kernel" in sections and device == "cuda":  # last: a read out of bounds would end the GPU's use
        guarded("kernel prefill past 2**31 elements", prefill_past_int32)
    report("done", seconds=round(time.perf_counter() - t0, 1), failed=FAILED)
    return 1 if FAILED else 0


def guarded(name: str, check: Callable[..., object], *args: object) -> None:
    """``check(*args)``; an exception is reported as the failed check ``name`` (its type, message and the
    innermost lines of the traceback) and the run goes on: the device's minutes are few, and one broken path
    must not cost the measurements of the others."""
    try:
        check(*args)
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
        frames = traceback.extract_tb(e.__traceback__)[-3:]
        where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]
        said = str(e).splitlines()[0][:300] if str(e) else ""
        report(f"{name} raised", ok=False, error=f"{type(e).__name__}: {said}", at=where)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def prefill_past_int32() -> None:
    """The fused prefill's rows past 2**31 elements of q equal to the same rows computed alone."""
    from check_fused_prefill import past_int32

    found = past_int32()
    report("kernel prefill past 2**31 elements", ok=found["equal"], **found)


def kernel_check(device: str) -> None:
    """The fused kernels' own scripts (prefill, decode), those this checkout has. Each runs with its own
    defaults (``sys.argv`` holds check.py's flags, which its parser would refuse); in a dry run with
    ``TRITON_INTERPRET=1``, their own dry runs (small, in the interpreter), else none."""
    import runpy

    from selfextend.core.fused_prefill import interpreting

    dry = device != "cuda"
    for kernel in ("prefill", "decode"):
        script = Path(__file__).with_name(f"check_fused_{kernel}.py")
        if (dry and not interpreting()) or not script.exists():
            report(f"kernel {kernel}", note="skipped (a dry run without TRITON_INTERPRET=1, or no script)")
            continue
        argv, sys.argv = sys.argv, [str(script), *(["--dry-run"] if dry else [])]
        try:
            guarded(f"kernel {kernel}", runpy.run_path, str(script), None, "__main__")
        except SystemExit as e:
            report(f"kernel {kernel}", ok=not e.code, exit=e.code)
        finally:
            sys.argv = argv


if __name__ == "__main__":
    sys.exit(main())
