"""The Triton kernels of :mod:`selfextend.core.fused_decode`: one query token over a layer's cells, split-K.

:func:`decode_partials_kernel`: one program per (KV head, run of ``split`` cells) walks its run in tiles of
``BLOCK_N`` cells under an online softmax, for all query heads reading that KV head at once (GQA in place:
each key and value is read once). Per tile it reads the cells' positions first, and loads the keys and values
of the visible cells only (cells not in use, at a position after every query, and cells outside a sliding
window are masked lanes: no memory read). The query heads are the rows of a matrix product on the matrix units
(in row groups of 4 or more, four groups: 16 rows, their smallest tile, where the grouped query's and the
probabilities' parts take what would be padding): scores and the probabilities' product with the values
accumulate in float32 (16-bit cells multiplied as stored, exact products; float32 operands as three TF32
products), which keeps a tile's values in a few registers a thread where sums of broadcast products held all
of them (255 registers and spills, compiled for sm_90: experiments/gpu/kernel_build.py). With Self-Extend, the
cells at distance >= W are scored against the grouped query with their keys at grouped positions: read where
the cache keeps them (``STORED``: in place of the key, a plain cell's bytes), else rotated here by the key
table's row at their position (rotate-half over the first ``ROT_DIM`` dimensions). Each program writes its
rows' running max, sum and unnormalised output; :func:`decode_merge_kernel` merges a head's runs by their
maxima (log-sum-exp).

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


from selfextend.core.fused_step_kernel import _round  # noqa: E402 (after the no-triton stand-ins)


@_jit
def _dot(a, b, acc, LOW: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in float32 on the matrix units: 16-bit operands as they are where ``LOW`` (their
    products exact in float32), else float32 ones split in three TF32 products (``tf32x3``: float32's
    accuracy, where plain TF32 keeps 10 bits); ``UPCAST``: float32 ``ieee`` (the interpreter, whose
    16-bit products are wrong in triton 3.9 and which takes no ``tf32x3``)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif LOW:
        out = tl.dot(a, b, acc)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")
    return out


@_jit
def _split(x, dtype: tl.constexpr, LOW: tl.constexpr):
    """float32 ``x`` as three parts whose products with another operand sum to x's: where ``LOW``, hi, mid
    and lo in ``dtype`` (x = hi + mid + lo to float32's precision, each product with a 16-bit operand
    exact, which is never widened; two parts leave errors of 2^-17, as large as the tests' tolerance),
    else x and two zeros."""
    if LOW:
        hi = x.to(dtype)
        rest = x - hi.to(tl.float32)
        mid = rest.to(dtype)
        lo = (rest - mid.to(tl.float32)).to(dtype)
    else:
        hi, mid, lo = x, tl.zeros_like(x), tl.zeros_like(x)
    return hi, mid, lo


@_jit
def _stack(a, b, c, d):
    """Four (R, N) tensors of one type as the (4 R, N) rows of one matrix product's operand, in row groups
    ``a, b, c, d``: a product of 16 rows (the matrix units' smallest tile) carries what four products of R
    real rows and 16 - R padding rows would."""
    t = tl.arange(0, 4)[:, None, None]  # (4, 1, 1) the row group
    out = tl.where(t == 0, a[None], tl.where(t == 1, b[None], tl.where(t == 2, c[None], d[None])))
    return tl.reshape(out, (4 * a.shape[0], a.shape[1]))


@_jit
def _groups(x, R: tl.constexpr):
    """A product's (4 R, N) rows as ``(first, rest)`` (R, N): its first row group, and the sum of the other
    three (:func:`_stack`'s)."""
    x3 = tl.reshape(x, (4, R, x.shape[1]))  # (4, R, N)
    t = tl.arange(0, 4)[:, None, None]
    return tl.sum(tl.where(t == 0, x3, 0.0), 0), tl.sum(tl.where(t == 0, 0.0, x3), 0)


@_jit
def decode_partials_kernel(
    q_ptr,
    qg_ptr,
    k_ptr,
    kg_ptr,
    v_ptr,
    pos_ptr,
    last_ptr,
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
    s_gkh,
    s_gkn,
    s_gkd,
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
    LIMITED: tl.constexpr,
    GROUPED: tl.constexpr,
    STORED: tl.constexpr,
    LOW: tl.constexpr,
    UPCAST: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (Hkv, n_splits): KV head ``hk`` (query heads ``hk * n_rep`` on, ``BLOCK_R`` >= 4 rows of which
    the first ``n_rep`` are real), cells ``[s * split, (s + 1) * split)``. Writes acc (H, n_splits, D), m
    and l (H, n_splits) at its rows: unnormalised output, running max (-inf where nothing was visible) and
    running sum of the scaled scores' exponentials.

    A tile is two matrix products of ``4 * BLOCK_R`` rows (:func:`_stack`): the scores of the query (row
    group 0) and of the grouped query's parts (groups 1-3, :func:`_split`) against the tile's keys, each
    cell's key or its stored grouped key as it needs; then the probabilities' parts against the values,
    accumulated by row group and summed once at the end. Self-Extend's grouped scores and float32's
    accuracy with 16-bit cells so cost no product of their own (on an H200 at 32k cells with Self-Extend,
    seven products a tile of 16 rows, 4 of them real, took 0.082 ms a layer; these 0.067).

    Where ``LIMITED``, the cells in use are the slots up to the one at ``last_ptr`` (read on the device):
    a program past them reads nothing. Every load of a cell is masked by its visibility rather than skipped
    by a branch, so the loop's loads are pipelined and a cell not visible (outside a sliding window, at a
    later position) costs its position only: a masked lane reads no memory."""
    hk = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = offs_r < n_rep
    d_ok = offs_d < HEAD_DIM
    heads = hk * n_rep + offs_r  # (BLOCK_R,) the query heads of this KV head
    q_ok = r_ok[:, None] & d_ok[None, :]  # (BLOCK_R, BLOCK_D)
    q = tl.load(q_ptr + heads[:, None] * s_qh + offs_d[None, :] * s_qd, mask=q_ok, other=0.0)
    if not LOW:
        q = q.to(tl.float32)
    none = tl.zeros_like(q)
    rows = _stack(q, none, none, none)  # (4 BLOCK_R, BLOCK_D)
    if GROUPED:
        q_g = tl.load(qg_ptr + heads[:, None] * s_gh + offs_d[None, :] * s_gd, mask=q_ok, other=0.0)
        if STORED:  # the grouped query's parts in row groups 1-3: the keys' product scores both kinds
            g_hi, g_mid, g_lo = _split(q_g, q.dtype, LOW)
            rows = _stack(q, g_hi, g_mid, g_lo)
        else:  # the keys rotated here in float32, so one float32 product (16-bit values exact in it)
            rows = _stack(q.to(tl.float32), q_g, tl.zeros_like(q_g), tl.zeros_like(q_g))
        half = ROT_DIM // 2
        rot = (offs_d < ROT_DIM)[:, None]  # (BLOCK_D, 1): keys are read transposed
        swap = tl.where(offs_d < half, offs_d + half, offs_d - half)  # rotate-half's partner of each dim
    p = tl.load(pos_ptr)  # the query's position, read on the device
    k_base = k_ptr + hk * s_kh
    kg_base = kg_ptr + hk * s_gkh
    v_base = v_ptr + hk * s_vh
    zero = tl.zeros([4 * BLOCK_R, BLOCK_N], dtype=tl.float32)

    m_i = tl.zeros([BLOCK_R], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([4 * BLOCK_R, BLOCK_D], dtype=tl.float32)  # by row group, summed at the end
    lo = s * split
    n_in = n_cells
    if LIMITED:
        n_in = tl.minimum(n_cells, tl.load(last_ptr) + 1)
    for start in range(lo, tl.minimum(lo + split, n_in), BLOCK_N):
        cells = (start + offs_n).to(tl.int64)  # (BLOCK_N,) slots (int64: offsets past 2**31 elements)
        in_range = cells < n_in
        at = tl.load(cell_ptr + cells * s_cell, mask=in_range, other=0)  # (BLOCK_N,) int64 positions
        distance = p - at
        visible = in_range & (distance >= 0)
        if SLIDING:
            visible = visible & (distance < window)
        grouped = visible & (distance >= group_window)
        k_tile = k_base + cells[None, :] * s_kn  # (1, BLOCK_N): keys read transposed, (BLOCK_D, BLOCK_N)
        if STORED:  # a grouped cell's stored key is read instead of its key: a plain cell's bytes
            k_ok = d_ok[:, None] & (visible & (distance < group_window))[None, :]
            g_ok = d_ok[:, None] & grouped[None, :]
            k_t = tl.load(k_tile + offs_d[:, None] * s_kd, mask=k_ok, other=0.0)
            kg_t = tl.load(kg_base + cells[None, :] * s_gkn + offs_d[:, None] * s_gkd, mask=g_ok, other=0.0)
            k_t = k_t + kg_t  # each cell's key as its scores need it (the other one masked to 0)
        else:
            k_t = tl.load(k_tile + offs_d[:, None] * s_kd, mask=d_ok[:, None] & visible[None, :], other=0.0)
        if GROUPED and not STORED:
            row = tl.minimum(at, n_table - 1)[None, :]  # (1, BLOCK_N) the key table's row
            g_ok = rot & grouped[None, :]  # (BLOCK_D, BLOCK_N)
            cos = tl.load(cos_ptr + row * s_cn + offs_d[:, None] * s_cd, mask=g_ok, other=1.0)
            sin = tl.load(sin_ptr + row * s_sn + offs_d[:, None] * s_sd, mask=g_ok, other=0.0)
            k_sw = tl.load(k_tile + swap[:, None] * s_kd, mask=g_ok, other=0.0).to(tl.float32)
            k_t = k_t.to(tl.float32)
            k_t = tl.where(grouped[None, :], k_t * cos + k_sw * sin, k_t)  # grouped keys at j // G
            sc, g_sc = _groups(_dot(rows, k_t, zero, False, UPCAST), BLOCK_R)  # (BLOCK_R, BLOCK_N) each
        else:
            sc, g_sc = _groups(_dot(rows, k_t, zero, LOW, UPCAST), BLOCK_R)
        if GROUPED:
            sc = tl.where(grouped[None, :], g_sc, sc)
        sc = tl.where(visible[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: p and alpha 0, not NaN
        p_ij = tl.exp(sc - m_use[:, None])  # (BLOCK_R, BLOCK_N)
        alpha = tl.exp(m_i - m_use)  # 0 where nothing was seen before (m_i -inf)
        l_i = l_i * alpha + tl.sum(p_ij, 1)
        v = tl.load(
            v_base + cells[:, None] * s_vn + offs_d[None, :] * s_vd,
            mask=visible[:, None] & d_ok[None, :],
            other=0.0,
        )
        p_hi, p_mid, p_lo = _split(p_ij, v.dtype, LOW)
        alpha_rows = tl.reshape(tl.broadcast_to(alpha[None, :], (4, BLOCK_R)), (4 * BLOCK_R,))
        acc = _dot(_stack(p_hi, p_mid, p_lo, tl.zeros_like(p_hi)), v, acc * alpha_rows[:, None], LOW, UPCAST)
        m_i = m_new

    out = tl.sum(tl.reshape(acc, (4, BLOCK_R, BLOCK_D)), 0)  # (BLOCK_R, BLOCK_D) the row groups' sum
    part = heads * n_splits + s  # (BLOCK_R,) rows of the (H, n_splits) partials
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_ok)
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
    e^(m_s - M) l_s`` with ``M`` the largest max (runs that saw nothing weigh 0), rounded to o's type."""
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
    tl.store(o_ptr + h * HEAD_DIM + offs_d, _round(out / tl.sum(den, 0), o_ptr.dtype.element_ty), mask=d_ok)
