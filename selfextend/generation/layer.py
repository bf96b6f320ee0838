"""One decoder layer of the decode step for B rows: the description of the step's math that the compiled,
captured and batched paths run (:func:`layer_rows`).

It reads the model's modules and writes each row's new key and value into its cells; attention is
:func:`~selfextend.generation.step_attention.attend`. Where the fused step kernels run
(:func:`~selfextend.core.fused_step.fused_step_applies`: a GPU, or Triton's interpreter), the norms, the
gated activation and the rotation with the cells' writes are one kernel each, computing what the modules
and tensor operations compute (:mod:`selfextend.core.fused_step`); a norm or activation they do not know
stays the module's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from selfextend.core.fused_step import (
    ACTIVATIONS,
    KeyWrite,
    RowNorm,
    fused_gated,
    fused_rms_norm,
    fused_rope_write,
    fused_step_applies,
)
from selfextend.core.rope import Rotation
from selfextend.generation.products import RMS_NORMS, activation_name, project
from selfextend.generation.step_attention import GroupedRotations, attend


class LayerCells(NamedTuple):
    """One row's cells in one layer: keys and values (1, Hkv, capacity, D), positions (n,) of the first
    ``n`` slots, the new token's slot (1,) (where the layer writes its key, value and position), and the
    keys at grouped positions the cache keeps, or None."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    slot: torch.Tensor
    grouped: torch.Tensor | None = None


def row_norm(module: nn.Module | None) -> RowNorm | None:
    """``module`` as the fused kernels compute it where it is one of the families' RMSNorms, else None."""
    weight = getattr(module, "weight", None)
    if type(module).__name__ not in RMS_NORMS or weight is None:
        return None
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    return RowNorm(weight, float(eps), RMS_NORMS[type(module).__name__])


def _norm(module: nn.Module, x: torch.Tensor, fused: bool) -> torch.Tensor:
    spec = row_norm(module) if fused else None
    return module(x) if spec is None else fused_rms_norm(x, spec)[1]


def add_norm(module: nn.Module, x: torch.Tensor, y: torch.Tensor, fused: bool) -> tuple[torch.Tensor, ...]:
    """``(x + y, norm(x + y))``: the residual stream after a block and the next block's normed input (one
    kernel where ``fused``: :func:`~selfextend.core.fused_step.fused_step_applies`)."""
    spec = row_norm(module) if fused and y.dtype == x.dtype and y.shape == x.shape else None
    if spec is None:
        s = x + y
        return s, module(s)
    return fused_rms_norm(x, spec, add=y)


def _gated(mlp: nn.Module, y: torch.Tensor, fused: bool) -> torch.Tensor:
    """``act(gate) * up`` of [gate, up] (..., 2I)."""
    name = activation_name(mlp)
    if fused and name in ACTIVATIONS:
        return fused_gated(y, name)
    gate, up = y.chunk(2, dim=-1)
    return mlp.act_fn(gate) * up


def _head_norms(attn: nn.Module, dtype: torch.dtype) -> tuple[RowNorm, RowNorm] | None | bool:
    """The q/k norms as the fused rotation applies them: None where the attention has none, False where
    it has ones the kernel does not know (the tensor operations then rotate)."""
    if not hasattr(attn, "q_norm"):
        return None
    q, k = row_norm(attn.q_norm), row_norm(attn.k_norm)
    if q is None or k is None or (q.eps, q.offset) != (k.eps, k.offset):
        return False
    if any(n.weight.shape != (attn.head_dim,) or n.weight.dtype != dtype for n in (q, k)):
        return False
    return q, k


def _rotated_rows(
    attn: nn.Module,
    qkv: torch.Tensor,
    rot: Rotation,
    pos: torch.Tensor,
    cells: list[LayerCells],
    grouped: GroupedRotations | None,
    fused: bool,
) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """Per row ``b`` of ``qkv`` (B, 1, (H + 2 Hkv) * D): its key, value and position written into
    ``cells[b]`` (and the key at its grouped position where the cells keep those), and ``(q, q_g,
    stored)``: its rotated queries (1, H, 1, D), the grouped ones where the fused kernel made them, and the
    grouped keys of the cells in use."""
    b_rows, d = qkv.shape[0], attn.head_dim
    n_kv = cells[0].keys.shape[1]
    n_heads = qkv.shape[-1] // d - 2 * n_kv
    norms = _head_norms(attn, qkv.dtype) if fused else False
    out = []
    if norms is not False:
        tables = None if grouped is None else (grouped.keys, grouped.queries)
        for b, c in enumerate(cells):
            at = b if rot.cos.shape[0] > 1 else 0
            q, q_g = fused_rope_write(
                qkv[b].reshape(-1),
                n_heads,
                d,
                Rotation(rot.cos[at], rot.sin[at]),
                pos[b : b + 1],
                KeyWrite(c.keys, c.values, c.positions, c.slot, c.grouped),
                tables,
                norms,
            )
            stored = None if c.grouped is None else c.grouped[:, :, : c.positions.shape[0]]
            out.append((q, q_g, stored))
        return out
    qkv = qkv.view(b_rows, 1, -1, d)  # (B, 1, H + 2 Hkv, D)
    q, k, v = qkv.split([n_heads, n_kv, n_kv], dim=2)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rot.apply(q.transpose(1, 2)), rot.apply(k.transpose(1, 2))  # (B, H, 1, D)
    v = v.transpose(1, 2)  # (B, Hkv, 1, D)
    for b, c in enumerate(cells):
        at, stored = pos[b : b + 1], None
        c.positions.index_copy_(0, c.slot, at)
        key = k[b : b + 1].to(c.keys.dtype)
        c.keys.index_copy_(2, c.slot, key)
        c.values.index_copy_(2, c.slot, v[b : b + 1].to(c.values.dtype))
        if c.grouped is not None:  # the new key at its grouped position too, rounded as the cache keeps it
            rk = grouped.keys
            c.grouped.index_copy_(2, c.slot, Rotation(rk.cos[:, :, at], rk.sin[:, :, at]).apply(key))
            stored = c.grouped[:, :, : c.positions.shape[0]]
        out.append((q[b : b + 1], None, stored))
    return out


def layer_rows(
    layer: nn.Module,
    qkv_parts: tuple[nn.Module, ...],
    gate_up_parts: tuple[nn.Module, ...],
    x: torch.Tensor,
    rot: Rotation,
    pos: torch.Tensor,
    cells: list[LayerCells],
    window: int | None,
    grouped: GroupedRotations | None,
    pending: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer for B rows, the residual stream (B, 1, hidden) before it being ``x + pending``:
    returns ``(x', pending')`` whose sum is the stream after it (the last block's output left to add, so
    that the next layer adds it in the kernel of its first norm), each row's key, value and position written
    into its ``cells``. The unit that is compiled: every layer of a model has the same code and the same
    shapes, so one graph serves them all (the layer's weights are its inputs), and compiling it costs one
    layer's trace, not the whole model's."""
    attn = layer.self_attn
    fused = fused_step_applies(x)
    x, h = add_norm(layer.input_layernorm, x, pending, fused)
    qkv = project(qkv_parts, h)  # (B, 1, (H + 2 Hkv) * D)
    outs = []
    for (q, q_g, stored), c, at in zip(
        _rotated_rows(attn, qkv, rot, pos, cells, grouped, fused), cells, pos.split(1), strict=True
    ):
        n = c.positions.shape[0]
        kb, vb = c.keys[:, :, :n], c.values[:, :, :n]  # (1, Hkv, n, D): the cells in use, the new one too
        outs.append(
            attend(
                q, kb, vb, c.positions, at, attn.scaling, window, grouped,
                stored=stored, q_g=q_g, last=c.slot, out_dtype=x.dtype,
            )
        )  # fmt: skip
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (B, 1, H * D)
    out = attn.o_proj(out)
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: norms after attention and MLP too
        x, h = add_norm(
            layer.pre_feedforward_layernorm, x, _norm(layer.post_attention_layernorm, out, fused), fused
        )
    else:
        x, h = add_norm(layer.post_attention_layernorm, x, out, fused)
    out = layer.mlp.down_proj(_gated(layer.mlp, project(gate_up_parts, h), fused))
    if hasattr(layer, "post_feedforward_layernorm"):
        out = _norm(layer.post_feedforward_layernorm, out, fused)
    return x, out
