"""The fused Self-Extend prefill kernel (Triton): equal to the reference in Triton's interpreter, and taken
by self_extend_attention exactly where it applies (CUDA tensors, triton installed, gapless keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import selfextend.core.attention as attention
import selfextend.core.fused_prefill as fused_prefill
from selfextend.core.attention import self_extend_attention, self_extend_attention_reference
from selfextend.core.cells import KeyCells
from selfextend.core.rope import rotate

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "fused_prefill_cases.py"


def test_kernel_equals_reference_in_the_interpreter():
    """Every case of fused_prefill_cases.py (G 1-4, W inside and past the length, chunked prefill, GQA 4/2
    and 4/1, head sizes 16-128, float32, bfloat16, float16, softcap, lengths off the tiles, strided views,
    rows whose every score is far below 0: they were NaN) within its dtype's tolerance; six of them
    through self_extend_attention's dispatch, three of those split (the grouped pairs through torch's
    causal kernel, the band in ours); the grouped rotation's kernel against ``rotate``."""
    # triton 3.6's interpreter (the GPU machines' of issue 48) cannot run a loop whose bounds come from
    # program_id under numpy 2.4 ("only 0-dimensional arrays can be converted"); the kernels compile there
    # (experiments/gpu/kernel_build.py run with triton 3.6 for sm_90: none failed)
    pytest.importorskip("triton", minversion="3.9")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, str(CASES)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results, dispatched = rows[:-1], rows[-1]
    assert len(results) >= 23 and dispatched == {"dispatched": 6, "split": 3}
    assert [r for r in results if not r["error"] < r["tol"]] == []


def _like(device: str, dtype: torch.dtype = torch.bfloat16, d: int = 128) -> SimpleNamespace:
    """What the predicate reads of a tensor (a CUDA tensor cannot be made without a GPU)."""
    return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, 32, 4096, d))


def test_fused_prefill_applies_where_it_can(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fused_prefill, "triton_available", lambda: True)
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 90)  # an H100/H200
    gapless, gaps = KeyCells(torch.arange(8), 0), KeyCells(torch.tensor([0, 2, 3]), None)
    cuda = _like("cuda")
    assert fused_prefill.fused_prefill_applies(cuda, cuda, gapless)
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 75)  # a T4: no bf16 products
    assert not fused_prefill.fused_prefill_applies(cuda, cuda, gapless)
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 90)
    assert not fused_prefill.fused_prefill_applies(cuda, cuda, gaps)  # positions with gaps: by position
    assert not fused_prefill.fused_prefill_applies(_like("cpu"), _like("cpu"), gapless)
    assert not fused_prefill.fused_prefill_applies(_like("cuda", d=512), _like("cuda", d=512), gapless)
    assert not fused_prefill.fused_prefill_applies(
        _like("cuda", torch.int8), _like("cuda", torch.int8), gapless
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs it on CPU tensors
    assert fused_prefill.fused_prefill_applies(_like("cpu"), _like("cpu"), gapless)
    monkeypatch.setattr(fused_prefill, "triton_available", lambda: False)
    assert not fused_prefill.fused_prefill_applies(cuda, cuda, gapless)


def test_self_extend_attention_dispatch(monkeypatch):
    """Where the predicate holds, self_extend_attention hands the kernel q, k, v and the grouped q/k it
    built (the first Lk - W keys); elsewhere the two-pass path runs, equal to the reference."""
    torch.manual_seed(0)
    d, lq, lk, group, window = 16, 30, 50, 4, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    q, k, v = torch.randn(1, 4, lq, d), torch.randn(1, 2, lk, d), torch.randn(1, 2, lk, d)
    k_pos = torch.arange(lk)[None]
    q_pos = k_pos[:, lk - lq :]
    args = (rotate(q, q_pos, inv_freq), rotate(k, k_pos, inv_freq), v, q_pos, group, window, inv_freq)
    taken = []

    def kernel(q, k, v, q_g, k_g, window, scale, softcap=None, grouped=None):
        shapes = [None if x is None else tuple(x.shape) for x in (q_g, k_g)]
        taken.append((*shapes, window, scale, softcap))
        assert grouped is None  # float32 rows: never split (tests/fused_prefill_cases.py runs the split)
        return torch.zeros_like(q)

    turned = []

    def turn(x, delta, inv_freq):  # the grouped rotation's kernel: rotate's math, counted
        turned.append(tuple(x.shape))
        return rotate(x, delta, inv_freq)

    monkeypatch.setattr(attention, "fused_self_extend_prefill", kernel)
    monkeypatch.setattr(attention, "fused_rotate", turn)
    monkeypatch.setattr(attention, "fused_prefill_applies", lambda q, k, cells: False)
    reference = self_extend_attention_reference(q, k, v, q_pos, k_pos, group, window, inv_freq)
    assert (self_extend_attention(*args) - reference).abs().max() < 1e-5 and taken == []
    monkeypatch.setattr(attention, "fused_prefill_applies", lambda q, k, cells: cells.first is not None)
    assert turned == []  # (the two-pass path rotates with torch's ops)
    assert self_extend_attention(*args, softcap=3.0).abs().max() == 0
    assert taken == [((1, 4, lq, d), (1, 2, lk - window, d), window, d**-0.5, 3.0)]
    assert turned == [(1, 2, lk - window, d), (1, 4, lq, d)]  # the grouped keys, then queries
    self_extend_attention(*args[:4], 1, window, inv_freq)  # G = 1: no grouped q/k (plain causal)
    assert taken[-1][:2] == (None, None)
