"""The Triton kernel of :mod:`selfextend.core.fused_prefill`: Self-Extend prefill under one online softmax.

One program takes a block of query rows of one head and walks the key blocks its rows can see, in four
ranges that need less and less of the work on the way to the causal diagonal:

1. blocks every row sees at grouped positions: ``q_g . k_g`` only, no mask;
2. blocks that straddle the neighbor window: both products, the one of each pair picked by distance;
3. blocks every row sees at normal positions, none past the diagonal: ``q . k`` only, no mask;
4. blocks at the diagonal: ``q . k`` with the causal mask.

A flash-attention-2 online softmax (running max, running sum, float32 accumulator) runs over all four,
in base 2. Without triton installed this module still imports (the CPU package does not need triton):
the kernels are then plain functions nobody calls.
"""

from types import SimpleNamespace

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ModuleNotFoundError:  # no triton: nothing here runs, :func:`fused_prefill.applies` says so first
    triton = None
    tl = SimpleNamespace(constexpr=lambda value: value)

    def _jit(fn):  # type: ignore[no-redef]
        return fn


LOG2E = tl.constexpr(1.4426950408889634)  # the softmax runs in base 2: exp(x) = exp2(x * log2(e))
GROUPED = tl.constexpr(0)  # which products a range of key blocks needs: q_g . k_g only,
BOTH = tl.constexpr(1)  # both, picked per pair by distance,
NEIGHBOR = tl.constexpr(2)  # q . k only


@_jit
def _load(ptrs, n_ok, d_ok, CHECK_N: tl.constexpr, PAD_D: tl.constexpr):
    """A tile, masked only where the key count or the head size's padding needs it (zeros outside)."""
    if CHECK_N:
        if PAD_D:
            x = tl.load(ptrs, mask=n_ok & d_ok, other=0.0)
        else:
            x = tl.load(ptrs, mask=n_ok, other=0.0)
    else:
        if PAD_D:
            x = tl.load(ptrs, mask=d_ok, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@_jit
def _dot(a, b, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in float32: exact float32 products where ``IEEE`` (no TF32), and the operands
    widened first where ``UPCAST`` (the interpreter's bfloat16 products are wrong in triton 3.9)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@_jit
def _key_range(
    acc,
    l_i,
    m_i,
    q,
    q_g,
    k_base,
    kg_base,
    v_base,
    stride_kn,
    stride_kd,
    stride_gn,
    stride_gd,
    stride_vn,
    stride_vd,
    rows,
    lo,
    hi,
    lk,
    n_grouped,
    window,
    qk_scale,
    softcap,
    MODE: tl.constexpr,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PAD_D: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The online softmax over key slots ``[lo, hi)`` for query rows at slots ``rows`` (BLOCK_M,).

    ``MODE`` says which products the range needs (GROUPED, BOTH, NEIGHBOR); ``MASKED`` adds the causal mask
    and the key-count bounds (ranges 2 and 4). Returns the updated (acc, l_i, m_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    d_col = (offs_d < HEAD_DIM)[:, None]  # (BLOCK_D, 1): for transposed key tiles
    d_row = (offs_d < HEAD_DIM)[None, :]  # (1, BLOCK_D): for value tiles
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n  # (BLOCK_N,) key slots
        if MODE != GROUPED:
            k_t = _load(
                k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                (cols < lk)[None, :],
                d_col,
                MASKED,
                PAD_D,
            )  # (BLOCK_D, BLOCK_N)
            s_n = _dot(q, k_t, zero, IEEE, UPCAST)
        if MODE != NEIGHBOR:
            kg_t = _load(
                kg_base + cols[None, :] * stride_gn + offs_d[:, None] * stride_gd,
                (cols < n_grouped)[None, :],
                d_col,
                MASKED,
                PAD_D,
            )  # (BLOCK_D, BLOCK_N)
            s_g = _dot(q_g, kg_t, zero, IEEE, UPCAST)
        if MODE == GROUPED:
            s = s_g
        elif MODE == NEIGHBOR:
            s = s_n
        else:
            s = tl.where(rows[:, None] - cols[None, :] < window, s_n, s_g)  # (BLOCK_M, BLOCK_N)
        if SOFTCAP:  # cap * tanh(scaled / cap), tanh through exp (no tanh among the long-stable tl ops)
            x = s * (qk_scale / softcap)
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * (softcap * LOG2E)
        else:
            s = s * (qk_scale * LOG2E)
        if MASKED:
            visible = (cols[None, :] <= rows[:, None]) & (cols[None, :] < lk)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load(
            v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            (cols < lk)[:, None],
            d_row,
            MASKED,
            PAD_D,
        )  # (BLOCK_N, BLOCK_D)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@_jit
def self_extend_prefill_kernel(
    q_ptr,
    qg_ptr,
    k_ptr,
    kg_ptr,
    v_ptr,
    o_ptr,
    s_qb,
    s_qh,
    s_qm,
    s_qd,
    s_gb,
    s_gh,
    s_gm,
    s_gd,
    s_kb,
    s_kh,
    s_kn,
    s_kd,
    s_cb,
    s_ch,
    s_cn,
    s_cd,
    s_vb,
    s_vh,
    s_vn,
    s_vd,
    s_ob,
    s_oh,
    s_om,
    s_od,
    n_heads,
    n_rep,
    lq,
    lk,
    n_grouped,
    window,
    qk_scale,
    softcap,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    PAD_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One block of query rows of one (batch, head): grid (cdiv(Lq, BLOCK_M), B * H), the longest blocks
    (last rows, most keys) launched first. Query head ``h`` reads KV head ``h // n_rep`` in place."""
    m_block = tl.cdiv(lq, BLOCK_M) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    hk = h // n_rep
    m0 = m_block * BLOCK_M
    off = lk - lq  # query row r sits at key slot off + r
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = off + offs_m  # (BLOCK_M,) the rows' slots
    q_ok = (offs_m < lq)[:, None] & (offs_d < HEAD_DIM)[None, :]  # (BLOCK_M, BLOCK_D)
    q_tile = offs_m[:, None] * s_qm + offs_d[None, :] * s_qd
    g_tile = offs_m[:, None] * s_gm + offs_d[None, :] * s_gd
    q_base = q_ptr + b * s_qb + h * s_qh
    qg_base = qg_ptr + b * s_gb + h * s_gh
    k_base = k_ptr + b * s_kb + hk * s_kh
    kg_base = kg_ptr + b * s_cb + hk * s_ch
    v_base = v_ptr + b * s_vb + hk * s_vh

    # The four ranges (each a multiple of BLOCK_N from 0, every row sees slot 0, so the running max is
    # finite after the first block): [0, g_end) grouped for every row, [g_end, b_end) the window's edge,
    # [b_end, d_start) neighbors for every row and none past the diagonal, [d_start, hi) the diagonal.
    hi = tl.minimum(lk, off + m0 + BLOCK_M)
    g_end = (tl.maximum(off + m0 - window + 1, 0) // BLOCK_N) * BLOCK_N  # row m0's grouped slots: <= off+m0-W
    n_from = tl.cdiv(tl.maximum(off + m0 + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N  # last row's neighbors
    b_end = tl.minimum(tl.maximum(n_from, g_end), hi)
    d_start = tl.maximum(((off + m0 + 1) // BLOCK_N) * BLOCK_N, b_end)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    q_g = tl.load(qg_base + g_tile, mask=q_ok, other=0.0)
    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q_g, q_g, k_base, kg_base, v_base, s_kn, s_kd, s_cn, s_cd, s_vn, s_vd,
        rows, 0, g_end, lk, n_grouped, window, qk_scale, softcap,
        GROUPED, False, SOFTCAP, PAD_D, IEEE, UPCAST, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    q = tl.load(q_base + q_tile, mask=q_ok, other=0.0)
    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q, q_g, k_base, kg_base, v_base, s_kn, s_kd, s_cn, s_cd, s_vn, s_vd,
        rows, g_end, b_end, lk, n_grouped, window, qk_scale, softcap,
        BOTH, True, SOFTCAP, PAD_D, IEEE, UPCAST, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q, q, k_base, kg_base, v_base, s_kn, s_kd, s_cn, s_cd, s_vn, s_vd,
        rows, b_end, d_start, lk, n_grouped, window, qk_scale, softcap,
        NEIGHBOR, False, SOFTCAP, PAD_D, IEEE, UPCAST, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q, q, k_base, kg_base, v_base, s_kn, s_kd, s_cn, s_cd, s_vn, s_vd,
        rows, d_start, hi, lk, n_grouped, window, qk_scale, softcap,
        NEIGHBOR, True, SOFTCAP, PAD_D, IEEE, UPCAST, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=q_ok)
