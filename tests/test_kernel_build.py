"""The fused Triton kernels compile for a GPU (sm_90: H100/H200; sm_80: A100) though this machine has none.

The kernels' tests run them in Triton's interpreter, which never compiles them; a launch a GPU's compiler
refuses (a tile its matrix units cannot take, a lowering missing for a type) would pass them and fail on
the first GPU. experiments/gpu/kernel_build.py compiles the real wrappers' launches with triton's own
compiler and ptxas (both in the triton wheel); this runs it on the launches the GPU checks start with."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
# a kernel's row: name, tiles, registers, spilled bytes, shared memory, programs per SM, loop sizes
KERNEL = re.compile(r"(?P<kernel>\w+_kernel)\s+\S+\s+(?P<regs>\d+)\s+\d+\s+\d+\s+\d+\s*(?P<loops>[\d/]*)$")
CASES = [
    "prefill bf16 d128",  # the 8B shape's Self-Extend prefill
    "prefill f32 d64",  # float32 models (the interpreter tests' type)
    "prefill bf16 d256 softcap",  # Gemma 2's soft-capped scores, the largest head
    "decode bf16 d128 stored gqa4",  # the 8B shape's captured decode step with Self-Extend
    "decode bf16 d128 grouped gqa4",  # grouped keys rotated in the kernel (a cache not keeping them)
    "decode f32 d128 sliding gqa1",  # a sliding layer's cells, no shared KV heads
    "step norm bf16 4096 add",  # the step's elementwise kernels on the 8B shape's rows
    "step gated bf16 14336",
    "step rope bf16 d128 se norms",
]


def _build(arch: int, cases: list[str]) -> subprocess.CompletedProcess:
    """kernel_build.py on ``cases`` for ``sm_{arch}``: exit 1 where one fails to compile or asks for more
    shared memory than that GPU gives a program."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, str(ROOT / "experiments/gpu/kernel_build.py"), "--arch", str(arch)]
    for case in cases:
        args += ["--case", case]
    return subprocess.run(
        args, capture_output=True, text=True, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=600
    )


@pytest.mark.parametrize("arch", [90, 80])  # H100/H200 (the defaults' tiles), A100 (its own)
def test_the_fused_kernels_compile_for_a_gpu(arch: int) -> None:
    done = _build(arch, CASES)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(tuple(CASES))]
    built = [KERNEL.search(line) for line in rows]
    assert None not in built, rows
    kernels = {m["kernel"] for m in built}  # each kernel was built
    walking = {"self_extend_prefill_kernel", "decode_partials_kernel"}  # the kernels with a loop
    assert kernels == walking | {
        "decode_merge_kernel",
        "rms_norm_kernel",
        "gated_kernel",
        "rope_write_kernel",
    }
    assert {case for case in CASES if any(line.startswith(case) for line in rows)} == set(CASES)
    for m in built:  # registers a thread, read from the cubin: a real program, within the hardware's 255
        assert 0 < int(m["regs"]) <= 255, m.string
    for m in built:  # the kernels that walk cells or keys have a loop, and it holds instructions
        if m["kernel"] in walking:
            assert m["loops"] and min(map(int, m["loops"].split("/"))) > 50, m.string


def test_the_cards_with_99_kib_of_shared_memory_get_tiles_that_fit() -> None:
    """sm_89 (RTX 40, L4, L40S; sm_86 alike): the grouped 256-wide keys rotated in the decode kernel (a
    Gemma's sliding layers with Self-Extend) took 112 KiB of shared memory a program there, a launch the
    GPU refuses; their tiles and the prefill's are now chosen for it."""
    done = _build(89, ["decode bf16 d256 grouped gqa2", "prefill f16 d128"])  # (f16: bf16 has tilings)
    assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(("decode", "prefill"))]
    assert any("decode_partials_kernel" in line for line in rows), rows
