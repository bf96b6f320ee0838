"""Self-Extend attention kernels: a memory-efficient one and a plain full-matrix reference.

Both compute, for each query row, one softmax over the merged scores: the neighbor score
(normal positions) where ``i - j < W`` and the grouped score (positions from
``selfextend.core.positions``) elsewhere.

Keys come with their positions (:class:`KeyCells`, attached by the KV cache to the keys it returns),
in increasing order, the queries' own keys last. A decode step (one query row) takes
:func:`~selfextend.core.decode_query.self_extend_decode`, which needs no mask.

For prefill on CUDA with triton installed, gapless keys take one fused Triton kernel
(:mod:`selfextend.core.fused_prefill`); a long 16-bit prefill (:data:`SPLIT_ROWS`) takes its grouped pairs
from cuDNN's causal attention first and the kernel walks only the neighbor band. Elsewhere the efficient
kernel never builds a (Lq, Lk) score matrix: it runs two attention passes with a fused kernel that also
returns the log-sum-exp of each row (:mod:`selfextend.core.attend`), and merges them exactly:

- neighbor pass: query blocks against only the keys of their band ``(i - W, i]``;
- grouped pass: in slot space, query row ``r`` (at slot ``off + r``) sees keys
  ``s <= off + r - W``, which is a plain causal pattern after an offset, so it runs as one
  causal call (plus one unmasked call for keys every row sees).

Both passes assume gapless keys (slot ``s`` at position ``last_query_pos - (Lk-1-s)``, as with every
transformers cache). Keys with gaps in their positions take :func:`attention_by_position`, which masks by
position, query block by query block, so memory stays (block, Lk) there too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from selfextend.core.attend import attend, attend_split, merge_into, warn_fallback
from selfextend.core.cells import KeyCells, read_once
from selfextend.core.decode_query import grouped_prefix, self_extend_decode
from selfextend.core.fused_prefill import fused_prefill_applies, fused_rotate, fused_self_extend_prefill
from selfextend.core.masked import attention_by_position, repeat_kv, soft_cap
from selfextend.core.positions import grouped_key_positions, grouped_query_positions, is_neighbor
from selfextend.core.rope import RotationTable, rotate

NEIGHBOR_BLOCK = 256
# Prefills of this many query rows or more, in 16-bit floats, split Self-Extend in two on the fused path:
# the grouped pairs through torch's causal kernel (cuDNN's on an H200: 610 TFLOP/s where our kernel makes
# 420), then the neighbor band in our kernel, each row's softmax starting from the grouped result. Shorter
# ones take the one kernel (a new shape costs cuDNN a plan, worth it only over many rows).
SPLIT_ROWS = 4096


def _neighbor_pass(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row against the keys of its band (i - W, i], block by block."""
    lq, lk = q.shape[-2], k.shape[-2]
    off = lk - lq
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    block = NEIGHBOR_BLOCK
    for r0 in range(0, lq, block):
        r1 = min(r0 + block, lq)
        s0, s1 = max(0, off + r0 - window + 1), off + r1
        rows = torch.arange(off + r0, off + r1, device=q.device)[:, None]
        cols = torch.arange(s0, s1, device=q.device)[None, :]
        distance = rows - cols
        allowed = (distance >= 0) & is_neighbor(distance, window)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~allowed, float("-inf")
        )
        out[..., r0:r1, :], lse[..., r0:r1] = attend(
            q[..., r0:r1, :], k[..., s0:s1, :], v[..., s0:s1, :], scale, mask=mask, softcap=softcap
        )
    return out, lse


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scale: float,
    q_pos: torch.Tensor | None = None,
    cells: KeyCells | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention over the last ``window`` slots only (``i - j < window``), as the sliding layers of
    hybrid models attend: q (B, H, Lq, D) at the last Lq slots of k/v (B, Hkv, Lk, D) -> (B, H, Lq, D).

    The neighbor pass, block by block, so neither an (Lq, Lk) mask nor (Lq, Lk) scores exist:
    transformers' SDPA path builds a dense boolean mask (4 GiB at 64k tokens) and scores every pair.
    Keys whose ``cells`` have gaps are masked by position instead (``q_pos`` (B or 1, Lq) required then).
    ``softcap``: attention logit soft-capping (Gemma 2).
    """
    if cells is not None and cells.first is None:
        return attention_by_position(q, k, v, q_pos, cells.positions, scale, sliding=window, softcap=softcap)
    out, _ = _neighbor_pass(q, k, v, window, scale, softcap)
    return out


def grouped_pass(
    q_g: torch.Tensor,
    k_g: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scale: float,
    softcap: float | None,
    attend_with: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """Query rows against keys at distance >= W, at grouped positions (through ``attend_with``, default
    :func:`~selfextend.core.attend.attend`).

    ``k_g`` holds only the first ``Lk - W`` keys (the ones any row can see grouped).
    Returns (first row that has grouped keys, out, lse for rows from it on), or None.
    """
    call = attend_with or attend
    lq = q_g.shape[-2]
    n_grouped = k_g.shape[-2]  # = Lk - W
    c = n_grouped - lq  # row r sees grouped keys 0 .. r + c
    if c < 0:
        first = -c
        if first >= lq:
            return None
        out, lse = call(q_g[..., first:, :], k_g, v[..., :n_grouped, :], scale, True, softcap=softcap)
        return first, out, lse
    out, lse = call(q_g, k_g[..., c:, :], v[..., c:n_grouped, :], scale, True, softcap=softcap)
    if c > 0:
        out_a, lse_a = call(q_g, k_g[..., :c, :], v[..., :c, :], scale, softcap=softcap)
        out, lse = merge_into(out, lse, out_a, lse_a)
    return 0, out, lse


def split_applies(q: torch.Tensor) -> bool:
    """Whether a fused prefill of ``q`` takes its grouped pairs from torch's causal kernel first
    (:data:`SPLIT_ROWS`): 16-bit floats, where cuDNN runs, and many rows."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-2] >= SPLIT_ROWS


def _split_grouped(
    q_g: torch.Tensor, k_g: torch.Tensor, v: torch.Tensor, window: int, scale: float
) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """The split's grouped pairs, or None where cuDNN refuses them (said once; the one kernel runs)."""
    try:
        return grouped_pass(q_g, k_g, v, window, scale, None, attend_split)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:
        warn_fallback(e, "cuDNN refused Self-Extend's grouped pairs ({}); every pair in the one kernel")
        return None


def untagged_cells(k: torch.Tensor, q_pos: torch.Tensor) -> KeyCells:
    """Cells of keys no cache tagged: the queries' own keys when as many (no cache: their positions), else
    gapless and ending at each row's last query (transformers' caches). Positions (B or 1, Lk); ``first``
    that of row 0 when every row is gapless (the decode path, which reads it, runs only when every row is at
    the same position)."""
    lk, lq = k.shape[-2], q_pos.shape[-1]
    if lk == lq:
        return KeyCells(q_pos, _first(q_pos, lk))
    positions = q_pos[:, -1:] - (lk - 1) + torch.arange(lk, device=k.device)  # (B, Lk)
    return KeyCells(positions, _first(q_pos, lk))


def _first(q_pos: torch.Tensor, lk: int) -> int | None:
    """``first`` of :func:`untagged_cells`, read on the host once per positions tensor (:func:`read_once`)."""
    lq = q_pos.shape[-1]
    if lk != lq:
        return read_once(q_pos, ("last", lk), lambda: int(q_pos[0, -1]) - (lk - 1))

    def first() -> int | None:
        return int(q_pos[0, 0]) if bool((q_pos[:, -1] - q_pos[:, 0] == lq - 1).all()) else None

    return read_once(q_pos, "first", first)


def self_extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    group_size: int,
    window: int,
    inv_freq: torch.Tensor,
    scale: float | None = None,
    cells: KeyCells | None = None,
    rotations: RotationTable | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Self-Extend attention for one unpadded problem, the queries' keys last.

    q (B, H, Lq, D) rotated at ``q_pos`` (B or 1, Lq); k/v (B, Hkv, Lk, D), keys rotated at the positions of
    ``cells`` (None: gapless, ending at ``q_pos[:, -1]``). Returns (B, H, Lq, D). Decode steps (Lq = 1) take a
    direct path, reading grouped keys from ``cells.grouped`` where the cache keeps them. ``softcap``:
    attention logit soft-capping of the scaled scores (Gemma 2).
    """
    lq, d, lk = q.shape[2], q.shape[3], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    q_pos = q_pos.to(q.device).long()
    cells = cells if cells is not None else untagged_cells(k, q_pos)
    last = q_pos[:, -1]
    if lq == 1 and (last.shape[0] == 1 or bool((last == last[0]).all())):
        pos = int(last[0])
        se = (group_size, window, inv_freq, scale, cells, rotations, softcap)
        return self_extend_decode(q, k, v, pos, *se)
    if cells.first is None:
        k_g = grouped_prefix(k, cells, lk, group_size, inv_freq) if group_size > 1 else k
        se = (group_size, window, inv_freq, k_g)
        return attention_by_position(q, k, v, q_pos, cells.positions, scale, self_extend=se, softcap=softcap)

    n_grouped = lk - window
    q_g = k_g = None
    fused = fused_prefill_applies(q, k, cells)
    if n_grouped > 0 and group_size > 1:  # G = 1: grouped positions are the normal ones
        turn = fused_rotate if fused else rotate
        k_g = grouped_prefix(k, cells, n_grouped, group_size, inv_freq, turn=turn)
        q_g = turn(q, grouped_query_positions(q_pos, group_size, window) - q_pos, inv_freq)
    if fused:
        grouped = None
        if q_g is not None and k_g is not None and softcap is None and split_applies(q):
            grouped = _split_grouped(q_g, k_g, v, window, scale)
        return fused_self_extend_prefill(q, k, v, q_g, k_g, window, scale, softcap, grouped=grouped)
    out, lse = _neighbor_pass(q, k, v, window, scale, softcap)
    if n_grouped <= 0:
        return out
    if q_g is None or k_g is None:
        q_g, k_g = q, k[..., :n_grouped, :]
    grouped = grouped_pass(q_g, k_g, v, window, scale, softcap)
    if grouped is not None:
        first, out_g, lse_g = grouped
        out[..., first:, :], _ = merge_into(out[..., first:, :], lse[..., first:], out_g, lse_g)
    return out


def self_extend_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    group_size: int,
    window: int,
    inv_freq: torch.Tensor,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The plain math, for tests and benchmarks: full score matrices from UN-rotated q and k.

    q (B, H, Lq, D) and k (B, Hkv, Lk, D) carry no rotation; positions q_pos (B, Lq), k_pos (B, Lk);
    ``key_mask`` (B, Lk) is False for padding. Rows with no visible key come out as zeros.
    """
    h, d = q.shape[1], q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    q_pos, k_pos = q_pos.to(q.device).long(), k_pos.to(q.device).long()
    n_rep = h // k.shape[1]
    q_n, k_n = rotate(q, q_pos, inv_freq).float(), rotate(k, k_pos, inv_freq).float()
    q_g = rotate(q, grouped_query_positions(q_pos, group_size, window), inv_freq).float()
    k_g = rotate(k, grouped_key_positions(k_pos, group_size), inv_freq).float()
    k_n, k_g, v_f = repeat_kv(k_n, n_rep), repeat_kv(k_g, n_rep), repeat_kv(v, n_rep).float()
    s_n = q_n @ k_n.transpose(-1, -2) * scale  # (B, H, Lq, Lk)
    s_g = q_g @ k_g.transpose(-1, -2) * scale  # (B, H, Lq, Lk)
    distance = (q_pos[:, :, None] - k_pos[:, None, :])[:, None]  # (B, 1, Lq, Lk)
    scores = soft_cap(torch.where(is_neighbor(distance, window), s_n, s_g), softcap)
    visible = distance >= 0
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :].bool()
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ v_f).to(v.dtype)
