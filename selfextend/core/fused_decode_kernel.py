"""The Triton kernels of :mod:`selfextend.core.fused_decode`: one query token over a layer's cells, split-K.

:func:`decode_partials_kernel`: one program per (KV head, run of ``split`` cells) walks its run in tiles of
``BLOCK_N`` cells under an online softmax, for all query heads reading that KV head at once (GQA in place:
each key and value is read once). Per tile it reads the cells' positions first, and skips the tile where
no cell is visible (cells not in use, at a position after every query; cells outside a sliding window):
their keys and values are never read. Scores are float32 sums of products (one query row per head: no
matrix product to feed); with Self-Extend a tile holding grouped cells (distance >= W) rotates their keys
by the key table's row at their position (rotate-half over the first ``ROT_DIM`` dimensions) and scores
them against the grouped query. Each program writes its rows' running max, sum and unnormalised output;
:func:`decode_merge_kernel` merges a head's runs by their maxima (log-sum-exp).

Without triton installed this module still imports: the kernels are then plain functions nobody calls.
"""

from types import SimpleNamespace

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ModuleNotFoundError:  # no triton: nothing here runs, :func:`fused_decode.applies` says so first
    triton = None
    tl = SimpleNamespace(constexpr=lambda value: value)

    def _jit(fn):  # type: ignore[no-redef]
        return fn


@_jit
def _scores(q, k):
    """q (BLOCK_R, BLOCK_D) against k (BLOCK_N, BLOCK_D) -> (BLOCK_R, BLOCK_N), float32 sums of products."""
    return tl.sum(q[:, None, :] * k[None, :, :], 2)  # (BLOCK_R, BLOCK_N, BLOCK_D) summed over D


@_jit
def decode_partials_kernel(
    q_ptr,
    qg_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cell_ptr,
    cos_ptr,
    sin_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    s_qh,
    s_qd,
    s_gh,
    s_gd,
    s_kh,
    s_kn,
    s_kd,
    s_vh,
    s_vn,
    s_vd,
    s_cell,
    s_cn,
    s_cd,
    s_sn,
    s_sd,
    n_cells,
    n_rep,
    n_splits,
    split,
    window,
    group_window,
    n_table,
    scale,
    SLIDING: tl.constexpr,
    GROUPED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (Hkv, n_splits): KV head ``hk`` (query heads ``hk * n_rep`` on), cells ``[s * split, (s + 1) *
    split)``. Writes acc (H, n_splits, D), m and l (H, n_splits) at its rows: unnormalised output, running
    max (-inf where nothing was visible) and running sum of the scaled scores' exponentials."""
    hk = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < n_rep
    d_ok = offs_d < HEAD_DIM
    heads = hk * n_rep + offs_r  # (BLOCK_R,) the query heads of this KV head
    q_ok = r_ok[:, None] & d_ok[None, :]  # (BLOCK_R, BLOCK_D)
    q = tl.load(q_ptr + heads[:, None] * s_qh + offs_d[None, :] * s_qd, mask=q_ok, other=0.0).to(tl.float32)
    if GROUPED:
        q_g = tl.load(qg_ptr + heads[:, None] * s_gh + offs_d[None, :] * s_gd, mask=q_ok, other=0.0)
        half = ROT_DIM // 2
        rot = offs_d < ROT_DIM
        swap = tl.where(offs_d < half, offs_d + half, offs_d - half)  # rotate-half's partner of each dim
    p = tl.load(pos_ptr)  # the query's position, read on the device
    k_base = k_ptr + hk * s_kh
    v_base = v_ptr + hk * s_vh

    m_i = tl.zeros([BLOCK_R], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    lo = s * split
    for start in range(lo, tl.minimum(lo + split, n_cells), BLOCK_N):
        cells = (start + offs_n).to(tl.int64)  # (BLOCK_N,) slots (int64: offsets past 2**31 elements)
        in_range = cells < n_cells
        at = tl.load(cell_ptr + cells * s_cell, mask=in_range, other=0)  # (BLOCK_N,) int64 positions
        distance = p - at
        visible = in_range & (distance >= 0)
        if SLIDING:
            visible = visible & (distance < window)
        if tl.max(visible.to(tl.int32), 0) > 0:  # else no key or value of this tile is read
            kv_ok = visible[:, None] & d_ok[None, :]  # (BLOCK_N, BLOCK_D)
            k_tile = k_base + cells[:, None] * s_kn
            k = tl.load(k_tile + offs_d[None, :] * s_kd, mask=kv_ok, other=0.0).to(tl.float32)
            if GROUPED:
                grouped = visible & (distance >= group_window)
                sc = _scores(q, k)  # (BLOCK_R, BLOCK_N): neighbors' scores
                if tl.max(grouped.to(tl.int32), 0) > 0:
                    row = tl.minimum(at, n_table - 1)[:, None]  # (BLOCK_N, 1) the key table's row
                    g_ok = grouped[:, None] & rot[None, :]  # (BLOCK_N, BLOCK_D)
                    cos = tl.load(cos_ptr + row * s_cn + offs_d[None, :] * s_cd, mask=g_ok, other=1.0)
                    sin = tl.load(sin_ptr + row * s_sn + offs_d[None, :] * s_sd, mask=g_ok, other=0.0)
                    k_sw = tl.load(k_tile + swap[None, :] * s_kd, mask=g_ok, other=0.0).to(tl.float32)
                    k_g = k * cos + k_sw * sin  # (BLOCK_N, BLOCK_D) keys at their grouped positions
                    sc = tl.where(grouped[None, :], _scores(q_g, k_g), sc)
            else:
                sc = _scores(q, k)
            sc = tl.where(visible[None, :], sc * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            p_ij = tl.exp(sc - m_new[:, None])  # (BLOCK_R, BLOCK_N)
            alpha = tl.exp(m_i - m_new)  # 0 where nothing was seen before (m_i -inf)
            l_i = l_i * alpha + tl.sum(p_ij, 1)
            v = tl.load(v_base + cells[:, None] * s_vn + offs_d[None, :] * s_vd, mask=kv_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.sum(p_ij[:, :, None] * v.to(tl.float32)[None, :, :], 1)
            m_i = m_new

    part = heads * n_splits + s  # (BLOCK_R,) rows of the (H, n_splits) partials
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_ok)
    tl.store(m_ptr + part, m_i, mask=r_ok)
    tl.store(l_ptr + part, l_i, mask=r_ok)


@_jit
def decode_merge_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    o_ptr,
    n_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (H,): head ``h``'s runs merged, ``o[h * D:(h + 1) * D] = sum_s e^(m_s - M) acc_s / sum_s
    e^(m_s - M) l_s`` with ``M`` the largest max (runs that saw nothing weigh 0)."""
    h = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    big = float("-inf")
    top = tl.full([BLOCK_S], big, dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        m = tl.load(m_ptr + h * n_splits + s0 + offs_s, mask=s0 + offs_s < n_splits, other=big)
        top = tl.maximum(top, m)
    top_m = tl.max(top, 0)
    den = tl.zeros([BLOCK_S], dtype=tl.float32)
    out = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        runs = s0 + offs_s
        ok = runs < n_splits
        m = tl.load(m_ptr + h * n_splits + runs, mask=ok, other=big)
        w = tl.where(m == big, 0.0, tl.exp(m - top_m))  # (BLOCK_S,)
        den += w * tl.load(l_ptr + h * n_splits + runs, mask=ok, other=0.0)
        part = acc_ptr + (h * n_splits + runs)[:, None] * HEAD_DIM + offs_d[None, :]
        acc = tl.load(part, mask=ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
        out += tl.sum(acc * w[:, None], 0)
    tl.store(o_ptr + h * HEAD_DIM + offs_d, out / tl.sum(den, 0), mask=d_ok)
