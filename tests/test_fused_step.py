"""The fused step kernels (core/fused_step.py): in Triton's interpreter against the modules and tensor
operations they replace (RMSNorms of Llama and Gemma with and without the residual's add, SwiGLU and
GeGLU, the rotation and writes of a token with q/k norms, partial rotary, Self-Extend's grouped query and
key, 16-bit and float32 models and cells), and the static step with them against the step without them
in bfloat16; where they apply; what the layer keeps in torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from selfextend.core import fused_prefill
from selfextend.core.fused_step import fused_step_applies
from selfextend.generation.layer import _head_norms, row_norm

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_equal_the_operations_they_replace_in_the_interpreter() -> None:
    """16-bit norms and rotations bit for bit but for an element a sum's order rounds the other way (at
    most 1 in 100, 3 in all); float32 within 1e-6 of the largest value, the activations too; the bf16
    static step's logits through a shift equal, and two caches' rows in one pass (q/k/v with biases, fused
    into one product)."""
    pytest.importorskip("triton", minversion="3.9")  # 3.6's interpreter fails our loops under numpy 2.4
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests/fused_step_cases.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    cases, together, static = rows[:-2], rows[-2], rows[-1]
    assert len(cases) >= 100
    wide = [r for r in cases if r["dtype"] == "torch.float32"]
    # GeGLU's tail (x << 0) cancels in 1 + tanh: a tanh a unit apart moves a tiny value a unit in bf16
    gated = [r for r in cases if r["case"].startswith("gated")]
    narrow = [r for r in cases if r not in wide and r not in gated]
    assert [r for r in wide + gated if not r["error"] < 1e-6] == []
    assert [r for r in narrow if not (r["error"] < 1e-2 and r["differ"] <= r["n"] // 100)] == []
    assert sum(r["differ"] for r in narrow) <= 3  # rounded where the operations round
    assert static["error"] == 0.0 and static["shifts"] >= 1 and static["fused_norms"] >= 20, static
    assert together == {"rows_step": "qwen2 bf16", "error": 0.0}  # two caches' rows, q/k/v with biases


def _like(device: str, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device), dtype=dtype)


def test_they_apply_where_the_other_fused_kernels_do(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fused_prefill, "triton_available", lambda: True)
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 90)
    assert fused_step_applies(_like("cuda")) and fused_step_applies(_like("cuda", torch.float32))
    assert not fused_step_applies(_like("cpu")) and not fused_step_applies(_like("cuda", torch.int8))
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 75)
    assert not fused_step_applies(_like("cuda"))
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 90)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the compiler fuses them itself
    assert not fused_step_applies(_like("cuda"))


def test_the_layer_keeps_what_the_kernels_do_not_know() -> None:
    """A norm of another kind stays the module's; q/k norms the rotation cannot apply (another eps, a
    weight of another type) leave the rotation to the tensor operations."""
    assert row_norm(torch.nn.LayerNorm(8)) is None and row_norm(None) is None
    spec = row_norm(LlamaRMSNorm(8, eps=1e-5))
    assert spec is not None and spec.eps == 1e-5 and not spec.offset
    attn = SimpleNamespace(head_dim=8, q_norm=LlamaRMSNorm(8, eps=1e-6), k_norm=LlamaRMSNorm(8, eps=1e-6))
    assert _head_norms(attn, torch.float32) is not False
    assert _head_norms(attn, torch.bfloat16) is False  # float32 weights in a bf16 model
    attn.k_norm = LlamaRMSNorm(8, eps=1e-5)
    assert _head_norms(attn, torch.float32) is False
    assert _head_norms(SimpleNamespace(head_dim=8), torch.float32) is None


def test_float_projections_fuse_into_views_where_the_kernels_run(monkeypatch) -> None:
    """On a GPU (simulated) a layer's q/k/v become one product whose weight the model's own projections
    now view (no second copy, the same values and outputs, biases too); on the CPU they stay as they are."""
    from conftest import make_model

    from selfextend.core import fused_prefill
    from selfextend.generation.decode import fuse_projections

    model = make_model("qwen2")  # q/k/v with biases
    attn = model.model.layers[0].self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn(3, model.config.hidden_size)
    want = torch.cat([p(x) for p in parts], dim=-1)
    before = [p.weight.clone() for p in parts]
    other = model.model.layers[1].self_attn
    cpu = [other.q_proj, other.k_proj, other.v_proj]
    assert fuse_projections(cpu) == tuple(cpu)  # the CPU: the modules themselves
    monkeypatch.setattr(fused_prefill, "kernels_run_on", lambda device: True)
    mlp = model.model.layers[1].mlp
    (fused,) = fuse_projections(parts)
    assert isinstance(fused, torch.nn.Linear) and fused.bias is not None
    torch.testing.assert_close(fused(x), want, rtol=0, atol=0)
    storage = fused.weight.untyped_storage().data_ptr()
    for p, w in zip(parts, before, strict=True):
        assert p.weight.untyped_storage().data_ptr() == storage and torch.equal(p.weight, w)
    torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=-1), want, rtol=0, atol=0)
    assert fuse_projections(parts)[0] is fused  # fused once
    (gate_up,) = fuse_projections([mlp.gate_proj, mlp.up_proj])
    assert gate_up.bias is None and gate_up.out_features == 2 * mlp.up_proj.out_features
    parts[1].weight.data.mul_(2)  # an edit in place: the fused layer views it
    assert fuse_projections(parts)[0] is fused
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=0, atol=0)
    parts[0].weight = torch.nn.Parameter(-parts[0].weight, requires_grad=False)  # replaced: fused again
    (again,) = fuse_projections(parts)
    assert again is not fused
    torch.testing.assert_close(again(x), torch.cat([p(x) for p in parts], dim=-1), rtol=0, atol=0)
