"""The fused decode attention kernels (Triton): equal to the decode step's tensor ops in Triton's
interpreter, the static step of a GPU equal to the direct step with them taken, and taken by ``attend``
exactly where they apply (CUDA tensors or the interpreter, triton installed, not while compiling)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import selfextend.core.fused_decode as fused_decode
import selfextend.core.fused_prefill as fused_prefill
import selfextend.generation.step_attention as step_attention
from selfextend.generation.step_attention import attend

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "fused_decode_cases.py"


def test_kernels_equal_attend_in_the_interpreter():
    """Every case of fused_decode_cases.py (plain, sliding rings, Self-Extend G 2-4 with W inside and past
    the cells and at distances W - 1 / W, cells not in use, GQA 4/1, 4/2, 6/2, 2/2, 16/2 (8 query heads a
    KV head: row groups of 8), 5/1, head sizes 16-128 and a partial rotary one, float32, bfloat16, float16,
    1-3 cells, counts off the tiles) within float32's
    tolerance, two through attend's dispatch; then GraphedDecode's static step with the kernels taken
    equals the direct step through a context shift (a Llama; a Gemma 3 with a sliding layer), run eagerly
    and recorded once then replayed as a CUDA graph would (tests/graph_replay.py)."""
    # triton 3.6's interpreter (the GPU machines' of issue 48) cannot run a loop whose bounds come from
    # program_id under numpy 2.4 ("only 0-dimensional arrays can be converted"); the kernels compile there
    # (experiments/gpu/kernel_build.py run with triton 3.6 for sm_90: none failed)
    pytest.importorskip("triton", minversion="3.9")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(CASES)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results, dispatched, static = rows[:-3], rows[-3], rows[-2:]
    assert len(results) >= 16 and dispatched == {"dispatched": 2}
    assert [r for r in results if not r["error"] < r["tol"]] == []
    assert [s["static_step"] for s in static] == ["llama", "gemma3"]
    assert all(s["shifts"] >= 1 and s["kernel_calls"] >= 10 and s["error"] < 1e-5 for s in static), static
    assert all(s["recorded_launches"] >= 2 for s in static), static  # the kernels replayed as launched


def _like(device: str, dtype: torch.dtype = torch.bfloat16, d: int = 128) -> SimpleNamespace:
    """What the predicate reads of a tensor (a CUDA tensor cannot be made without a GPU)."""
    return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, 32, 1, d))


def test_fused_decode_applies_where_it_can(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fused_prefill, "triton_available", lambda: True)
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 90)  # an H100/H200
    applies = fused_decode.fused_decode_applies
    cuda, cpu = _like("cuda"), _like("cpu")
    assert applies(cuda, cuda, cuda)
    assert applies(_like("cuda", torch.float32, 64), _like("cuda"), _like("cuda", torch.float16))
    assert not applies(cpu, cpu, cpu)  # the CPU's eager step keeps its tensor ops
    assert not applies(cuda, cpu, cpu)
    assert not applies(_like("cuda", d=512), _like("cuda", d=512), _like("cuda", d=512))
    assert not applies(cuda, _like("cuda", torch.int8), cuda)
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 80)  # an A100
    assert applies(cuda, cuda, cuda)
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 75)  # a T4: no bf16 products
    assert not applies(cuda, cuda, cuda)
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 90)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # torch.compile fuses attend's ops
    assert not applies(cuda, cuda, cuda)
    monkeypatch.undo()
    monkeypatch.setattr(fused_prefill, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs it on CPU tensors
    assert applies(cpu, cpu, cpu)
    monkeypatch.setattr(fused_prefill, "triton_available", lambda: False)
    assert not applies(cuda, cuda, cuda)


def test_attend_dispatch(monkeypatch):
    """Where the predicate holds, attend hands the kernels its arguments, with Self-Extend the query at its
    grouped position (float32), the keys' table and the grouped keys a cache keeps; elsewhere its tensor
    ops run."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    positions, pos = torch.arange(9), torch.tensor([8])
    params = SimpleNamespace(group_size=2, window=4, inv_freq=1.0 / (10000 ** (torch.arange(0, 16, 2) / 16)))
    grouped = step_attention.GroupedRotations.build(16, params)
    taken = []

    def kernel(q, k, v, positions, pos, scale, window, q_g=None, keys=None, group_window=0, **given):
        taken.append((window, None if q_g is None else (q_g.dtype, tuple(q_g.shape)), keys, group_window))
        kept.append(given.get("stored"))
        return torch.zeros(1, 1, 64)

    kept = []

    monkeypatch.setattr(step_attention, "fused_decode_attention", kernel)
    monkeypatch.setattr(step_attention, "fused_decode_applies", lambda q, k, v: False)
    assert attend(q, k, v, positions, pos, 0.25, None, grouped).abs().max() > 0 and taken == []
    monkeypatch.setattr(step_attention, "fused_decode_applies", lambda q, k, v: True)
    assert attend(q, k, v, positions, pos, 0.25, 5, None).abs().max() == 0
    attend(q, k, v, positions, pos, 0.25, None, grouped)
    assert taken == [(5, None, None, 0), (None, (torch.float32, (1, 4, 1, 16)), grouped.keys, 4)]
    stored = torch.randn(1, 2, 9, 16)  # the cache's grouped keys: handed on as they are
    attend(q, k, v, positions, pos, 0.25, None, grouped, stored=stored)
    assert kept[-1] is stored and kept[:2] == [None, None]
