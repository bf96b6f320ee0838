"""The Triton kernel of :mod:`selfextend.core.fused_prefill`: Self-Extend prefill under one online softmax.

One program takes a block of query rows of one head and walks the key blocks its rows can see. Seen from
the block, the keys fall in ranges that need less and less work on the way to the causal diagonal:

1. ``[0, g_end)``: every pair at distance >= W: ``q_g . k_g``, no mask;
2. ``[g_end, b_end)``: the window's edge, pairs of both kinds: walked twice, once ``q_g . k_g`` keeping the
   grouped pairs, once ``q . k`` keeping the neighbor ones (each loop one product: fewer live registers
   than both products and a per-element choice, and only a few blocks per row block);
3. ``[b_end, d_start)``: every pair a neighbor, none past the diagonal: ``q . k``, no mask;
4. ``[d_start, hi)``: the diagonal: ``q . k`` with the causal mask.

The softmax is order-free, so one flash-attention-2 online softmax (running max, running sum, float32
accumulator, in base 2) runs through all of them. Without triton installed this module still imports
(the CPU package does not need triton): the kernels are then plain functions nobody calls.
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
    k_base,
    v_base,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    rows,
    lo,
    hi,
    n_keys,
    lk,
    window,
    qk_scale,
    softcap,
    GROUPED: tl.constexpr,
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
    """The online softmax over key slots ``[lo, hi)`` (``n_keys`` of them in ``k_base``) for query rows at
    slots ``rows`` (BLOCK_M,): grouped pairs (distance >= W) where ``GROUPED``, else neighbor pairs.

    ``MASKED`` keeps only the pairs of that kind at or before the diagonal (ranges that are not entirely
    of one kind or that reach the diagonal); a row may then see nothing in a block, so the running max
    is guarded against -inf. Returns the updated (acc, l_i, m_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    d_col = (offs_d < HEAD_DIM)[:, None]  # (BLOCK_D, 1): for transposed key tiles
    d_row = (offs_d < HEAD_DIM)[None, :]  # (1, BLOCK_D): for value tiles
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n  # (BLOCK_N,) key slots
        at = tl.cast(start, tl.int64)  # the block's first slot: 64-bit offsets (int32 wraps past 2**31)
        k_t = _load(
            k_base + at * stride_kn + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            (cols < n_keys)[None, :],
            d_col,
            MASKED,
            PAD_D,
        )  # (BLOCK_D, BLOCK_N)
        s = _dot(q, k_t, zero, IEEE, UPCAST)  # (BLOCK_M, BLOCK_N)
        if SOFTCAP:  # cap * tanh(scaled / cap), tanh through exp (no tanh among the long-stable tl ops)
            x = s * (qk_scale / softcap)
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * (softcap * LOG2E)
        else:
            s = s * (qk_scale * LOG2E)
        if MASKED:
            distance = rows[:, None] - cols[None, :]  # (BLOCK_M, BLOCK_N)
            if GROUPED:
                keep = distance >= window  # these keys are all below n_keys = Lk - W
            else:
                # 0 <= distance < W in one unsigned compare (a negative distance wraps past every W; the
                # int32 window is promoted to uint32): 24-30 fewer registers than three tests at 128x64
                # tiles, where the Hopper tile spilled 80 bytes a thread (experiments/gpu/kernel_build.py).
                # No slot past the last key is kept: cols <= rows < lk for every real row
                keep = distance.to(tl.uint32) < window
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Nothing seen yet: p and alpha 0 against a max of 0, not NaN. The max itself stays -inf: kept
            # as 0 it would stand for the row's first scores, and scores far below 0 (-20 in float16, -120
            # in float32) would underflow against it to an empty sum, 0/0 at the end.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new  # (every pair here is seen: finite)
        p = tl.exp2(s - m_use[:, None]).to(v_base.dtype.element_ty)  # rounded as the product reads it
        alpha = tl.exp2(m_i - m_use)  # 0 where nothing was seen before (m_i -inf)
        if IEEE:  # float32 p: summed as it is (a float32 product would run off the matrix units)
            l_i = l_i * alpha[:, None] + tl.sum(p, 1)[:, None]
        else:  # the rows' sums of the rounded p, on the matrix units: p @ ones, every column a row's sum
            # (exact products, float32 sums), where summing p widened took a conversion and an add an
            # element and shuffles across a row's threads: 473 -> 392 instructions a 128x64 bf16 tile
            ones = tl.full([BLOCK_N, 16], 1.0, dtype=v_base.dtype.element_ty)
            l_i = _dot(p, ones, l_i * alpha[:, None], IEEE, UPCAST)
        v = _load(
            v_base + at * stride_vn + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
            (cols < lk)[:, None],
            d_row,
            MASKED,
            PAD_D,
        )  # (BLOCK_N, BLOCK_D)
        acc = _dot(p, v, acc * alpha[:, None], IEEE, UPCAST)
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
    go_ptr,
    glse_ptr,
    first,
    s_ib,
    s_ih,
    s_im,
    s_id,
    s_lb,
    s_lh,
    s_lm,
    BAND: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    PAD_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One block of query rows of one (batch, head): grid (B * H, cdiv(Lq, BLOCK_M)), heads varying fastest
    and the longest blocks (last rows, most keys) launched first, so the causal tail is short and the query
    heads sharing a KV head run side by side. Query head ``h`` reads KV head ``h // n_rep`` in place.

    ``BAND``: the grouped pairs were attended elsewhere (a causal kernel of the grouped queries over the
    grouped keys: :func:`~selfextend.core.fused_prefill.fused_self_extend_prefill`'s ``grouped``): row
    ``r >= first`` starts its softmax from that result's row ``r - first`` (``go``: its output, ``glse``:
    its natural log-sum-exp) and this program walks the neighbor pairs alone."""
    m_block = tl.cdiv(lq, BLOCK_M) - 1 - tl.program_id(1)
    bh = tl.program_id(0)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    hk = h // n_rep
    m0 = m_block * BLOCK_M
    off = lk - lq  # query row r sits at key slot off + r
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = off + offs_m  # (BLOCK_M,) the rows' slots
    q_ok = (offs_m < lq)[:, None] & (offs_d < HEAD_DIM)[None, :]  # (BLOCK_M, BLOCK_D)
    at = m0.to(tl.int64)  # the block's first row: offsets in 64 bits (a 512k-token q at 4096 a row: 2**31)
    in_m = tl.arange(0, BLOCK_M)[:, None]  # (BLOCK_M, 1) rows within the block
    q_tile = in_m * s_qm + offs_d[None, :] * s_qd
    g_tile = in_m * s_gm + offs_d[None, :] * s_gd
    q_base = q_ptr + b * s_qb + h * s_qh + at * s_qm
    qg_base = qg_ptr + b * s_gb + h * s_gh + at * s_gm
    k_base = k_ptr + b * s_kb + hk * s_kh
    kg_base = kg_ptr + b * s_cb + hk * s_ch
    v_base = v_ptr + b * s_vb + hk * s_vh

    # The ranges of the module's docstring, each starting at a multiple of BLOCK_N: [0, g_end) grouped for
    # every row, [g_end, b_end) the window's edge, [b_end, d_start) neighbors for every row and none past
    # the diagonal (whole blocks), [d_start, hi) the diagonal.
    hi = tl.minimum(lk, off + m0 + BLOCK_M)
    g_end = (tl.maximum(off + m0 - window + 1, 0) // BLOCK_N) * BLOCK_N  # row m0's grouped slots: <= off+m0-W
    n_from = tl.cdiv(tl.maximum(off + m0 + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N  # last row's neighbors
    b_end = tl.minimum(tl.maximum(n_from, g_end), hi)
    d_start = tl.maximum(((off + m0 + 1) // BLOCK_N) * BLOCK_N, b_end)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    if IEEE:  # each row's sum (16 times where the matrix units sum: see _key_range)
        l_i = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if BAND:  # the grouped result as the softmax's state: max lse (base 2), sum 1, accumulator its output
        has = (offs_m >= first) & (offs_m < lq)  # (BLOCK_M,) rows with grouped keys
        g_row = tl.where(has, offs_m - first, 0).to(tl.int64)
        lse = tl.load(glse_ptr + b * s_lb + h * s_lh + g_row * s_lm, mask=has, other=float("-inf"))
        m_i = lse * LOG2E
        l_i += tl.where(has, 1.0, 0.0)[:, None]
        go = go_ptr + b * s_ib + h * s_ih + g_row[:, None] * s_im + offs_d[None, :] * s_id
        acc += tl.load(go, mask=has[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
    else:
        q_g = tl.load(qg_base + g_tile, mask=q_ok, other=0.0)
        acc, l_i, m_i = _key_range(
            acc, l_i, m_i, q_g, kg_base, v_base, s_cn, s_cd, s_vn, s_vd,
            rows, 0, g_end, n_grouped, lk, window, qk_scale, softcap,
            True, False, SOFTCAP, PAD_D, IEEE, UPCAST, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        acc, l_i, m_i = _key_range(
            acc, l_i, m_i, q_g, kg_base, v_base, s_cn, s_cd, s_vn, s_vd,
            rows, g_end, b_end, n_grouped, lk, window, qk_scale, softcap,
            True, True, SOFTCAP, PAD_D, IEEE, UPCAST, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
        )  # fmt: skip
    q = tl.load(q_base + q_tile, mask=q_ok, other=0.0)
    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q, k_base, v_base, s_kn, s_kd, s_vn, s_vd,
        rows, g_end, b_end, lk, lk, window, qk_scale, softcap,
        False, True, SOFTCAP, PAD_D, IEEE, UPCAST, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q, k_base, v_base, s_kn, s_kd, s_vn, s_vd,
        rows, b_end, d_start, lk, lk, window, qk_scale, softcap,
        False, False, SOFTCAP, PAD_D, IEEE, UPCAST, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q, k_base, v_base, s_kn, s_kd, s_vn, s_vd,
        rows, d_start, hi, lk, lk, window, qk_scale, softcap,
        False, True, SOFTCAP, PAD_D, IEEE, UPCAST, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    out = acc / tl.max(l_i, 1)[:, None]  # (its columns are equal)
    o_ptrs = o_ptr + b * s_ob + h * s_oh + at * s_om + in_m * s_om + offs_d[None, :] * s_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=q_ok)


@_jit
def rotate_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    o_ptr,
    s_xb,
    s_xh,
    s_xl,
    s_xd,
    s_cb,
    s_cl,
    n_heads,
    length,
    HALF: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``x * cos + swap_halves(x) * sin`` (:meth:`~selfextend.core.rope.Rotation.apply`, every dimension
    rotating) for ``BLOCK_L`` rows of one (batch, head): x read once in its type, float32 inside, the
    result stored once in x's type into the contiguous (B, H, L, D) ``o``. Grid (B * H, cdiv(L, BLOCK_L))."""
    bh = tl.program_id(0)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    rows = (tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)  # (BLOCK_L,)
    cols = tl.arange(0, BLOCK_H)  # (BLOCK_H,) a half's dimensions
    ok = (rows < length)[:, None] & (cols < HALF)[None, :]
    x = x_ptr + b * s_xb + h * s_xh + rows[:, None] * s_xl + cols[None, :] * s_xd  # (BLOCK_L, BLOCK_H)
    lo = tl.load(x, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(x + HALF * s_xd, mask=ok, other=0.0).to(tl.float32)
    t = b * s_cb + rows[:, None] * s_cl + cols[None, :]
    c_lo, c_hi = tl.load(cos_ptr + t, mask=ok, other=0.0), tl.load(cos_ptr + t + HALF, mask=ok, other=0.0)
    s_lo, s_hi = tl.load(sin_ptr + t, mask=ok, other=0.0), tl.load(sin_ptr + t + HALF, mask=ok, other=0.0)
    o = o_ptr + ((b * n_heads + h) * length + rows[:, None]) * (2 * HALF) + cols[None, :]
    ty = o_ptr.dtype.element_ty
    tl.store(o, (lo * c_lo + hi * s_lo).to(ty), mask=ok)
    tl.store(o + HALF, (hi * c_hi + lo * s_hi).to(ty), mask=ok)
