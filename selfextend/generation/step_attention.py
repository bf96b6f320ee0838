"""One query row's attention over a layer's cells, as the compiled and captured decode steps compute it.

Which cells a query sees comes from their positions: a cell at ``j`` is visible to the query at ``p`` iff
``j <= p`` (and ``p - j < window`` on a sliding layer, whose cells may be in any order). With
Self-Extend, the score of a key with ``p - j >= W`` uses the grouped positions of
:mod:`selfextend.core.positions`: the cached key (rotated at ``j``) is rotated by ``j // G - j`` and the
query by its grouped offset, from tables of float32 factors computed once in float64
(:class:`GroupedRotations`). Positions are tensors and every size a shape, so the step compiles and is
captured; on a GPU the fused kernels of :mod:`selfextend.core.fused_decode` compute it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfextend.core.fused_decode import fused_decode_applies, fused_decode_attention
from selfextend.core.positions import grouped_key_positions, grouped_query_positions, is_neighbor
from selfextend.core.rope import Rotation
from selfextend.hf.patch import SelfExtendParams


@dataclass(frozen=True)
class GroupedRotations:
    """Self-Extend's extra rotations by position, float32 factors (1, 1, n, rot_dim) computed in float64:
    ``keys[j]`` turns a key cached at ``j`` into one at ``j // G``, ``queries[p]`` the query at ``p`` into
    one at its grouped position."""

    keys: Rotation
    queries: Rotation
    window: int

    @classmethod
    def build(cls, n: int, params: SelfExtendParams) -> GroupedRotations:
        """The tables for positions ``[0, n)`` under ``params`` (group size, window, frequencies)."""
        g, w, inv_freq = params.group_size, params.window, params.inv_freq
        at = torch.arange(n, device=inv_freq.device)
        keys = Rotation.of(grouped_key_positions(at, g) - at, inv_freq)
        queries = Rotation.of(grouped_query_positions(at, g, w) - at, inv_freq)
        return cls(keys, queries, w)

    def query_at(self, pos: torch.Tensor) -> Rotation:
        """The rotation (1, 1, 1, rot_dim) turning the query at ``pos`` (1,) into one at its grouped
        position (indexed on the device: nothing read on the host)."""
        return Rotation(self.queries.cos[:, :, pos], self.queries.sin[:, :, pos])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int | None,
    grouped: GroupedRotations | None,
    fused: bool = True,
    stored: torch.Tensor | None = None,
    q_g: torch.Tensor | None = None,
    last: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One query row over a layer's cells: q (1, H, 1, D) at ``pos`` (1,), k and v (1, Hkv, n, D) at
    ``positions`` (n,) -> (1, 1, H * D) in ``out_dtype``. One softmax over neighbor and grouped scores, the
    grouped keys rotated here or ``stored`` (1, Hkv, n, D) as the cache keeps them
    (:mod:`selfextend.kv.grouped`). On CUDA (or under Triton's interpreter) with triton installed, the fused
    kernels of :mod:`~selfextend.core.fused_decode` compute the same, reading each cell once (``fused`` False:
    the tensor ops anyway, what the kernels are checked and timed against). ``q_g``: the query at its grouped
    position (1, H, 1, D) float32 where the caller made it (the fused step's rotation), else made here.
    ``last`` (1,): the cells in use are the first ``last + 1`` (a static step's buffers hold stale positions
    after them), else all. Computed in float32, rounded to ``out_dtype`` (the next product's input type)."""
    if fused and fused_decode_applies(q, k, v):
        if grouped is None:
            return fused_decode_attention(
                q, k, v, positions, pos, scale, window, last=last, out_dtype=out_dtype
            )
        if q_g is None:
            q_g = grouped.query_at(pos).apply(q.float())  # (1, H, 1, D) float32
        keys, w = grouped.keys, grouped.window
        return fused_decode_attention(
            q,
            k,
            v,
            positions,
            pos,
            scale,
            window,
            q_g,
            keys,
            w,
            stored=stored,
            last=last,
            out_dtype=out_dtype,
        )
    b, hkv, _, d = k.shape
    qf = q.float().reshape(b, hkv, -1, d)  # (B, Hkv, H / Hkv, D): the heads sharing a KV head as rows
    kf = k.float()
    fused = torch.compiler.is_compiling()
    scores = _row_scores(qf, kf, fused)  # (B, Hkv, H / Hkv, n)
    distance = pos - positions  # (n,)
    visible = distance >= 0
    if last is not None:
        visible = visible & (torch.arange(positions.shape[0], device=positions.device) <= last)
    if window is not None:
        visible = visible & (distance < window)
    if grouped is not None:
        rk = grouped.keys
        at = positions.clamp(max=rk.cos.shape[2] - 1)  # a cell not in use (past every query) is masked below
        k_g = Rotation(rk.cos[:, :, at], rk.sin[:, :, at]).apply(kf) if stored is None else stored.float()
        grouped_q = grouped.query_at(pos).apply(qf)  # (B, Hkv, H / Hkv, D)
        scores = torch.where(
            is_neighbor(distance, grouped.window), scores, _row_scores(grouped_q, k_g, fused)
        )
    scores = (scores * scale).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if fused:
        out = (probs.unsqueeze(-1) * v.float().unsqueeze(-3)).sum(-2)  # (B, Hkv, H / Hkv, D)
    else:
        out = probs @ v.float()  # (B, Hkv, H / Hkv, D)
    return out.reshape(b, 1, -1).to(out_dtype)


def _row_scores(q: torch.Tensor, k: torch.Tensor, fused: bool) -> torch.Tensor:
    """q (B, Hkv, R, D) against k (B, Hkv, n, D) -> (B, Hkv, R, n); ``fused`` (compiling): a reduction the
    compiler fuses into one pass over the keys, not a matrix product of a few rows."""
    if fused:
        return (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1)  # (B, Hkv, R, n, D) summed over D
    return q @ k.transpose(-1, -2)
