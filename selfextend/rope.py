"""Rotary position embedding: extra rotations of vectors that are already rotated.

RoPE rotations compose: a vector rotated at position ``p`` and then by ``d`` equals the
vector rotated at ``p + d``. Keys cached after RoPE can therefore be moved to grouped
positions (Self-Extend) or to compacted positions (context shift) by one rotation of the
difference. The rotation is done in float32 with the model's own inverse frequencies and
without any ``attention_scaling`` factor: it must be a pure rotation.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves (the convention of Llama and kin)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, L, D) by ``delta`` positions; ``delta`` broadcasts to (B, L) or (L,).

    Only the first ``2 * len(inv_freq)`` dimensions rotate (partial rotary models); the rest
    pass through. Computed in float32, returned in ``x.dtype``.
    """
    rot_dim = 2 * inv_freq.shape[-1]
    delta = delta.to(device=x.device, dtype=torch.float32)
    if delta.dim() == 1:
        delta = delta[None]  # (1, L)
    angles = delta[:, None, :, None] * inv_freq.to(device=x.device, dtype=torch.float32)  # (B, 1, L, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (B, 1, L, rot_dim)
    x_rot = x[..., :rot_dim].float()
    out = x_rot * angles.cos() + rotate_half(x_rot) * angles.sin()
    if rot_dim < x.shape[-1]:
        out = torch.cat((out, x[..., rot_dim:].float()), dim=-1)
    return out.to(x.dtype)


def find_rotary_embedding(model: nn.Module) -> nn.Module:
    """The model's rotary embedding module (the one holding ``inv_freq``)."""
    found = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no rotary embedding (no module with inv_freq)")
    if len(found) > 1 and any(not torch.equal(found[0].inv_freq, m.inv_freq) for m in found[1:]):
        raise ValueError(f"{type(model).__name__} has several different rotary embeddings; not supported")
    return found[0]
