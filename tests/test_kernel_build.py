"""The fused Triton kernels compile for a GPU (sm_90: H100/H200; sm_80: A100) though this machine has none.

The kernels' tests run them in Triton's interpreter, which never compiles them; a launch a GPU's compiler
refuses (a tile its matrix units cannot take, a lowering missing for a type) would pass them and fail on
the first GPU. experiments/gpu/kernel_build.py compiles the real wrappers' launches with triton's own
compiler and ptxas (both in the triton wheel); this runs it on the launches the GPU checks start with."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    "prefill bf16 d128",  # the 8B shape's Self-Extend prefill
    "prefill f32 d64",  # float32 models (the interpreter tests' type)
    "prefill bf16 d256 softcap",  # Gemma 2's soft-capped scores, the largest head
    "decode bf16 d128 grouped gqa4",  # the 8B shape's captured decode step with Self-Extend
    "decode f32 d128 sliding gqa1",  # a sliding layer's cells, no shared KV heads
]


@pytest.mark.parametrize("arch", [90, 80])  # H100/H200 (the defaults' tiles), A100 (its own)
def test_the_fused_kernels_compile_for_a_gpu(arch: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, str(ROOT / "experiments/gpu/kernel_build.py"), "--arch", str(arch)]
    for case in CASES:
        args += ["--case", case]
    done = subprocess.run(
        args, capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(tuple(CASES))]
    assert f"sm_{arch}: " in done.stdout and " launches, 0 failed to compile" in done.stdout, done.stdout
    kernels = {line.split()[-6] for line in rows}  # the kernel column: each kernel was built
    assert kernels == {"self_extend_prefill_kernel", "decode_partials_kernel", "decode_merge_kernel"}, rows
    assert {case for case in CASES if any(line.startswith(case) for line in rows)} == set(CASES)
    for line in rows:  # registers a thread, read from the cubin: a real program, within the hardware's 255
        regs = int(line.split()[-4])
        assert 0 < regs <= 255, line
