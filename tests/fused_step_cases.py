"""The fused step kernels (selfextend/core/fused_step.py) against the modules and tensor operations they
replace, case by case, in Triton's interpreter; then the static decode step with them against the same
step without them, in bfloat16.

Run by tests/test_fused_step.py in a subprocess with ``TRITON_INTERPRET=1`` (set before triton is
imported). Prints one JSON line per case: the largest difference over the largest magnitude, and the
elements that differ at all (in 16-bit types a sum taken in another order may round one element to the
neighbouring value: one unit in the last place, 2^-8 relative in bfloat16). The kernels round to 16 bits
as a GPU does (to nearest): the interpreter's own bfloat16 conversion truncates.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import selfextend.generation.layer as layer_module
from selfextend.core.fused_step import fused_gated, fused_rms_norm
from selfextend.core.rope import Rotation
from selfextend.generation.layer import LayerCells, _rotated_rows, row_norm
from selfextend.generation.step_attention import GroupedRotations

sys.path.insert(0, str(Path(__file__).parent))


def _compare(name: str, got: torch.Tensor, want: torch.Tensor) -> dict[str, object]:
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype)
    dtype = str(want.dtype)
    got, want = got.float(), want.float()
    diff = (got - want).abs()
    return {
        "case": name,
        "dtype": dtype,
        "error": float(diff.max() / want.abs().max().clamp(min=1e-30)),
        "differ": int((diff > 0).sum()),
        "n": want.numel(),
    }


def norms() -> list[dict[str, object]]:
    """RMSNorms: Llama's and Gemma's modules, over 3 rows of 96 and of 1000, bf16 / fp16 / f32, with the
    residual's add before them."""
    out = []
    for kind, module in (("llama", LlamaRMSNorm), ("gemma", Gemma3RMSNorm)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for n in (96, 1000):
                torch.manual_seed(n)
                norm = module(n, eps=1e-6).to(dtype)
                with torch.no_grad():
                    norm.weight.normal_(0.3, 0.5)
                x, y = torch.randn(3, 1, n).to(dtype) * 3, torch.randn(3, 1, n).to(dtype)
                spec = row_norm(norm)
                with torch.no_grad():
                    _, got = fused_rms_norm(x, spec)
                    out.append(_compare(f"norm {kind} {n}", got, norm(x)))
                    s, got = fused_rms_norm(x, spec, add=y)
                    want = x + y
                    out.append(_compare(f"add+norm sum {kind} {n}", s, want))
                    out.append(_compare(f"add+norm {kind} {n}", got, norm(want)))
    return out


def gated() -> list[dict[str, object]]:
    """SwiGLU and GeGLU (tanh) on 2 rows of 2 x 1500 (two programs a row)."""
    out = []
    acts = {
        "silu": torch.nn.functional.silu,
        "gelu_pytorch_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    }
    for name, act in acts.items():
        for dtype in (torch.bfloat16, torch.float32):
            torch.manual_seed(1)
            y = (torch.randn(2, 1, 3000) * 3).to(dtype)
            gate, up = y.chunk(2, dim=-1)
            out.append(_compare(f"gated {name}", fused_gated(y, name), act(gate) * up))
    return out


class _Attn(torch.nn.Module):
    """What the rotation reads of an attention module: head size, and q/k norms where given."""

    def __init__(self, d: int, norm: type | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = d
        if norm is not None:
            self.q_norm, self.k_norm = norm(d, eps=1e-6).to(dtype), norm(d, eps=1e-6).to(dtype)
            with torch.no_grad():
                self.q_norm.weight.normal_(0.2, 0.4)
                self.k_norm.weight.normal_(0.2, 0.4)


ROPE_CASES = [  # (name, H, Hkv, D, rot_dim, model dtype, cells dtype, head norm, Self-Extend G W, stored)
    ("llama bf16", 4, 2, 64, 64, torch.bfloat16, torch.bfloat16, None, None, False),
    ("llama bf16 g4 w8 stored", 4, 2, 64, 64, torch.bfloat16, torch.bfloat16, None, (4, 8), True),
    ("llama bf16 g4 w8 rotated", 4, 1, 128, 128, torch.bfloat16, torch.bfloat16, None, (4, 8), False),
    ("partial rotary 32/64 g2", 4, 2, 64, 32, torch.bfloat16, torch.bfloat16, None, (2, 8), True),
    ("qwen3 norms bf16 g3", 6, 2, 64, 64, torch.bfloat16, torch.bfloat16, LlamaRMSNorm, (3, 8), True),
    ("gemma norms bf16", 4, 2, 32, 32, torch.bfloat16, torch.bfloat16, Gemma3RMSNorm, (2, 8), True),
    ("f32 model, bf16 cells g2", 4, 2, 64, 64, torch.float32, torch.bfloat16, None, (2, 8), True),
    ("fp16 d96 g2", 2, 2, 96, 96, torch.float16, torch.float16, None, (2, 8), True),
    ("f32 qwen3 norms", 4, 2, 16, 16, torch.float32, torch.float32, LlamaRMSNorm, (4, 4), True),
]


def rope(case: tuple) -> list[dict[str, object]]:
    """One token's rotation and writes for two rows (two caches), against the tensor operations of
    ``_rotated_rows`` on copies of the same cells: queries, grouped queries, keys, values, grouped keys."""
    name, h, hkv, d, rot_dim, dtype, cell_dtype, norm, se, stored = case
    torch.manual_seed(0)
    attn = _Attn(d, norm, dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    pos = torch.tensor([37, 52])
    rot = Rotation.of(pos.view(2, 1, 1).float(), inv_freq)  # (2, 1, 1, rot_dim)
    rot = Rotation(rot.cos.view(2, 1, 1, -1).to(dtype).float(), rot.sin.view(2, 1, 1, -1).to(dtype).float())
    grouped = None
    if se is not None:
        params = type("P", (), {"group_size": se[0], "window": se[1], "inv_freq": inv_freq})
        grouped = GroupedRotations.build(64, params)
    qkv = torch.randn(2, 1, (h + 2 * hkv) * d).to(dtype)
    results = []

    def cells() -> list[LayerCells]:
        made = []
        for b in range(2):
            g = torch.Generator().manual_seed(b)
            keys, values = (torch.randn(1, hkv, 70, d, generator=g).to(cell_dtype) for _ in range(2))
            kept = torch.randn(1, hkv, 70, d, generator=g).to(cell_dtype) if stored else None
            made.append(LayerCells(keys, values, torch.arange(60), torch.tensor([55 + b]), kept))
        return made

    got_cells, want_cells = cells(), cells()
    with torch.no_grad():
        got = _rotated_rows(attn, qkv, rot, pos, got_cells, grouped, fused=True)
        want = _rotated_rows(attn, qkv, rot, pos, want_cells, grouped, fused=False)
    for b in range(2):
        (q, q_g, kept), (wq, _, wkept) = got[b], want[b]
        results.append(_compare(f"rope {name} q", q, wq))
        if grouped is not None:
            wq_g = grouped.query_at(pos[b : b + 1]).apply(wq.float())
            results.append(_compare(f"rope {name} q_g", q_g, wq_g))
        for what in ("keys", "values", "positions", "grouped"):
            a, w = getattr(got_cells[b], what), getattr(want_cells[b], what)
            if a is not None:
                results.append(_compare(f"rope {name} {what}", a, w))
        assert (kept is None) == (wkept is None)
    return results


def static_step() -> dict[str, object]:
    """A bf16 Llama with Self-Extend through GraphedDecode's static step, with the fused step kernels and
    with the layer's tensor operations: the largest logit difference over 12 tokens through a shift."""
    from conftest import make_model

    from selfextend.generation.generator import Generator
    from selfextend.generation.graphed import GraphedDecode
    from selfextend.hf.patch import apply_self_extend
    from selfextend.kv.cache import ContextShiftCache

    model = make_model().to(torch.bfloat16)
    apply_self_extend(model, group_size=2, window=4)
    runs = []
    applies, norm = layer_module.fused_step_applies, layer_module.fused_rms_norm
    launches = []
    layer_module.fused_rms_norm = lambda *a, **k: launches.append(1) or norm(*a, **k)
    for fused in (True, False):
        layer_module.fused_step_applies = applies if fused else (lambda x: False)
        gen = Generator(model, ContextShiftCache(model, 24, n_keep=4, dtype=torch.bfloat16))
        gen.fast = GraphedDecode(model, capture=False, notify=print)
        out = gen.feed(list(range(3, 21)))
        steps = []
        for t in range(12):
            out = gen.write([40 + t])  # the same tokens on both runs
            steps.append(out)
        runs.append((torch.stack(steps).float(), gen.cache.shifts))
    layer_module.fused_step_applies, layer_module.fused_rms_norm = applies, norm
    (got, shifts), (want, _) = runs
    error = float((got - want).abs().max() / want.abs().max())
    return {"static_step": "llama bf16", "error": error, "shifts": shifts, "fused_norms": len(launches)}


def rows_step() -> dict[str, object]:
    """Two caches in one pass of the static step (a GPU server's slots: GraphedDecode.rows), a bf16 Qwen2
    (q/k/v biases) with Self-Extend, with the fused step kernels and without: the largest logit difference
    over 5 tokens."""
    from conftest import make_model

    from selfextend.generation.graphed import GraphedDecode
    from selfextend.hf.patch import apply_self_extend
    from selfextend.kv.cache import ContextShiftCache

    model = make_model("qwen2").to(torch.bfloat16)
    apply_self_extend(model, group_size=2, window=4)
    applies = layer_module.fused_step_applies
    runs = []
    for fused in (True, False):
        layer_module.fused_step_applies = applies if fused else (lambda x: False)
        graphed = GraphedDecode(model, capture=False, notify=print)
        caches = [ContextShiftCache(model, 40, n_keep=4, dtype=torch.bfloat16) for _ in range(2)]
        for cache, n in zip(caches, (9, 15), strict=True):  # prompts of two lengths, both past the window
            model(torch.arange(3, 3 + n)[None], past_key_values=cache, use_cache=True)
        steps = [graphed.rows([40 + t, 50 + t], caches) for t in range(5)]
        runs.append(torch.stack(steps).float())
    layer_module.fused_step_applies = applies
    got, want = runs
    return {"rows_step": "qwen2 bf16", "error": float((got - want).abs().max() / want.abs().max())}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for row in norms() + gated() + [r for case in ROPE_CASES for r in rope(case)]:
        print(json.dumps(row), flush=True)
    print(json.dumps(rows_step()), flush=True)
    print(json.dumps(static_step()), flush=True)


if __name__ == "__main__":
    main()
