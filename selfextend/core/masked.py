"""Attention masked by key position, for keys with gaps in their positions or in any order (a ring of cells).

The efficient kernels (:mod:`selfextend.core.attention`) cut their masks from slot arithmetic, which needs
gapless keys; this one compares positions, query block by query block, so memory stays (block, Lk).
"""

from __future__ import annotations

import torch

from selfextend.core.positions import grouped_query_positions, is_neighbor
from selfextend.core.rope import rotate

BLOCK = 256


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, L, D) -> (B, Hkv * n_rep, L, D), each KV head repeated for its query heads."""
    if n_rep == 1:
        return x
    b, h, seq, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, seq, d).reshape(b, h * n_rep, seq, d)


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Scaled scores through attention logit soft-capping (Gemma 2): ``cap * tanh(scores / cap)``; as they
    are for ``cap`` None."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def attention_by_position(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    sliding: int | None = None,
    self_extend: tuple[int, int, torch.Tensor, torch.Tensor] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention masked by position, for keys in any order: q (B, H, Lq, D) at ``q_pos`` (B or 1, Lq), k/v
    (B, Hkv, Lk, D) at ``k_pos`` (Lk,) or (B, Lk). A key is visible where ``0 <= q_pos - k_pos`` (and
    ``< sliding``); ``self_extend`` = (G, W, inv_freq, grouped keys (B, Hkv, Lk, D)) scores pairs at distance
    >= W at grouped positions; ``softcap`` caps the scaled scores (:func:`soft_cap`). Query block by query
    block, so memory stays (block, Lk). Rows with no visible key are zeros."""
    n_rep = q.shape[1] // k.shape[1]
    q_pos, k_pos = q_pos.to(q.device).long(), k_pos.to(q.device).long().reshape(-1, k.shape[-2])
    k_n, v_r = repeat_kv(k, n_rep).float(), repeat_kv(v, n_rep).float()
    if self_extend is not None:
        group_size, window, inv_freq, k_g = self_extend
        q_g = rotate(q, grouped_query_positions(q_pos, group_size, window) - q_pos, inv_freq)
        k_g = repeat_kv(k_g, n_rep).float()
    out = torch.empty_like(q)
    for r0 in range(0, q.shape[-2], BLOCK):
        r1 = min(r0 + BLOCK, q.shape[-2])
        distance = (q_pos[:, r0:r1, None] - k_pos[:, None, :])[:, None]  # (B, 1, c, Lk)
        scores = torch.matmul(q[..., r0:r1, :].float(), k_n.transpose(-1, -2)) * scale  # (B, H, c, Lk)
        if self_extend is not None:
            grouped = torch.matmul(q_g[..., r0:r1, :].float(), k_g.transpose(-1, -2)) * scale
            scores = torch.where(is_neighbor(distance, window), scores, grouped)
        scores = soft_cap(scores, softcap)
        visible = distance >= 0
        if sliding is not None:
            visible = visible & (distance < sliding)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
        out[..., r0:r1, :] = torch.matmul(probs, v_r).to(q.dtype)
    return out
