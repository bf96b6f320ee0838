"""Self-Extend for one query token: what its grouped scores read, and the attention itself.

A decode step (one query row) needs no mask: it scores the query at its grouped position against the keys
more than ``W`` positions back (at grouped positions, which the cache keeps between steps) and at its own
position against the rest, and takes one softmax over the concatenated row, with the query heads that share
a KV head as rows of one product. :func:`grouped_decode_keys` are the keys the grouped scores read, which
the decode step's native kernel (:mod:`selfextend.native.decode`) reads too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from selfextend.core.cells import KeyCells
from selfextend.core.masked import soft_cap
from selfextend.core.positions import grouped_key_positions, grouped_query_positions
from selfextend.core.rope import RotationTable, rotate

Turn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # rotate(x, delta, inv_freq)


def grouped_keys(
    k: torch.Tensor, k_pos: torch.Tensor, group_size: int, inv_freq: torch.Tensor, turn: Turn = rotate
) -> torch.Tensor:
    """Keys (B, Hkv, n, D) rotated at positions ``k_pos`` (n,) or (B, n) moved to their grouped positions
    (by ``turn``: :func:`~selfextend.core.rope.rotate` or a kernel of it)."""
    return turn(k, grouped_key_positions(k_pos, group_size) - k_pos, inv_freq)


def grouped_prefix(
    k: torch.Tensor,
    cells: KeyCells,
    n: int,
    group_size: int,
    inv_freq: torch.Tensor,
    rotations: RotationTable | None = None,
    dtype: torch.dtype | None = None,
    turn: Turn = rotate,
) -> torch.Tensor:
    """The first ``n`` keys at grouped positions, in ``dtype`` (default ``k``'s): from their owner when it
    keeps them (float32 for a narrower cache), else rotated here (by ``turn``)."""
    if cells.grouped is not None:
        return cells.grouped(group_size, inv_freq, n, rotations).to(dtype or k.dtype)
    return grouped_keys(k[..., :n, :], cells.positions[..., :n], group_size, inv_freq, turn)


def grouped_count(pos: int, window: int, lk: int, first: int | None, positions: torch.Tensor) -> int:
    """How many of ``lk`` keys a decode step's query at ``pos`` scores at grouped positions: the first ones,
    at distance >= W. ``first``: the first key's position when they are gapless (then integer arithmetic
    alone, what a decode step takes per layer), else None and their increasing ``positions`` are searched."""
    if first is not None:  # keys at positions <= pos - W are the first ones
        return min(max(pos - window - first + 1, 0), lk)
    return int(torch.searchsorted(positions, pos - window, right=True))


def grouped_decode_keys(
    k: torch.Tensor,
    pos: int,
    group_size: int,
    window: int,
    inv_freq: torch.Tensor,
    cells: KeyCells,
    rotations: RotationTable | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """The keys a decode step's query at ``pos`` scores at grouped positions: the first ones of ``k``
    (B, Hkv, Lk, D) at ``cells``, those at distance >= W, (B, Hkv, n_grouped, D) in ``dtype`` (default
    ``k``'s); None when every key is a neighbor or G is 1 (plain attention then)."""
    n_grouped = grouped_count(pos, window, k.shape[2], cells.first, cells.positions)
    if n_grouped == 0 or group_size == 1:
        return None
    return grouped_prefix(k, cells, n_grouped, group_size, inv_freq, rotations, dtype)


def self_extend_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: int,
    group_size: int,
    window: int,
    inv_freq: torch.Tensor,
    scale: float,
    cells: KeyCells,
    rotations: RotationTable | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query row per sequence, all at position ``pos``, against every key (all at positions <= pos):
    grouped scores for keys at distance >= W, neighbor scores for the others, one softmax over both.
    q (B, H, 1, D) -> (B, H, 1, D). ``rotations``: a table for the query's rotation (shared by layers);
    ``softcap``: attention logit soft-capping of the scaled scores (Gemma 2)."""
    b, h, _, d = q.shape
    hkv = k.shape[1]
    k_g = grouped_decode_keys(k, pos, group_size, window, inv_freq, cells, rotations)
    if k_g is None and softcap is None:
        # Every key at its own position: this is plain attention, so run the very op the unpatched model
        # decodes with. Another summation order differs in the last bits, which int8 weights (activations
        # rounded to bfloat16 before each product) amplify until a greedy token flips.
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    q = (q * scale).reshape(b, hkv, h // hkv, d)  # (B, Hkv, n_rep, D): the heads sharing a KV head as rows
    n_grouped = 0 if k_g is None else k_g.shape[2]
    scores = torch.matmul(q, k[..., n_grouped:, :].transpose(-1, -2))  # (B, Hkv, n_rep, Lk - n_grouped)
    if k_g is not None:
        delta = grouped_query_positions(pos, group_size, window) - pos
        if rotations is not None:
            q_g = rotations.rotate(q, delta, inv_freq)
        else:
            q_g = rotate(q, torch.tensor([delta], device=q.device), inv_freq)
        grouped = torch.matmul(q_g, k_g.transpose(-1, -2))  # (B, Hkv, n_rep, n_grouped)
        scores = torch.cat((grouped, scores), dim=-1)  # (B, Hkv, n_rep, Lk)
    scores = soft_cap(scores, softcap)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, h, 1, d)
