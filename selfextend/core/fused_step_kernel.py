"""The Triton kernels of :mod:`selfextend.core.fused_step`: the decode step's elementwise work, a launch each.

Each computes what the torch operations it replaces compute, rounding where they round (to the model's
type after a norm, a rotation, an activation; to the cells' type where a key or value is stored), in
float32 in between. Without triton installed this module still imports: the kernels are then plain
functions nobody calls.
"""

from types import SimpleNamespace

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ModuleNotFoundError:  # no triton: nothing here runs, :func:`fused_step.fused_step_applies` says so
    triton = None
    tl = SimpleNamespace(constexpr=lambda value: value)

    def _jit(fn):  # type: ignore[no-redef]
        return fn


@_jit
def _round(x, dtype: tl.constexpr):
    """``x`` rounded to ``dtype``, to nearest with ties to even, as a GPU's conversion rounds: a bfloat16 by
    its float32 bits (Triton's interpreter truncates a bfloat16 conversion instead; these are the GPU's
    numbers on both), others by conversion."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        out = x.to(dtype)
    return out


@_jit
def _snap(x, dtype: tl.constexpr):
    """``x`` rounded to ``dtype`` (:func:`_round`), back in float32: what the next operation reads."""
    return _round(x, dtype).to(tl.float32)


@_jit
def _tanh(x):
    """tanh through exp (stable for large |x|; no tanh among the long-stable tl ops)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@_jit
def rms_norm_kernel(
    x_ptr,
    y_ptr,
    w_ptr,
    sum_ptr,
    out_ptr,
    n,
    stride_x,
    stride_y,
    stride_s,
    stride_o,
    eps,
    ADD: tl.constexpr,
    OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row ``program_id(0)``: where ``ADD``, ``x + y`` first (rounded to x's type, as the residual stream
    is, and stored at ``sum_ptr``); then ``out = x / rms(x)`` times the weights: Llama's (the quotient
    rounded to x's type, times ``w``, rounded to out's type) or, where ``OFFSET``, Gemma's (times ``1 + w``
    in float32)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0)
        x = _round(x.to(tl.float32) + y.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    h = xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if OFFSET:
        out = h * (1.0 + w)
    else:
        out = _snap(h, x_ptr.dtype.element_ty) * w
    tl.store(out_ptr + row * stride_o + cols, _round(out, out_ptr.dtype.element_ty), mask=ok)


@_jit
def gated_kernel(y_ptr, out_ptr, n, stride_y, stride_o, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``program_id(0)`` of ``y`` = [gate, up] (2n): ``act(gate) * up`` (SiLU, or GELU's tanh form where
    ``GELU``), the activation rounded to the row's type before the product, as torch's two operations."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    g = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + row * stride_y + n + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU:
        a = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        a = g / (1.0 + tl.exp(-g))
    a = _snap(a, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, _round(a * up, out_ptr.dtype.element_ty), mask=ok)


@_jit
def _head(
    src,
    offs_d,
    partner,
    d_ok,
    norm_ptr,
    eps,
    HEAD_NORM: tl.constexpr,
    NORM_OFFSET: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One head's elements ``d`` and their rotation partners (float32 of the model's values), through the
    head's RMSNorm first where ``HEAD_NORM`` (rounded to the model's type as the norm's output is)."""
    a = tl.load(src + offs_d, mask=d_ok, other=0.0)
    b = tl.load(src + partner, mask=d_ok, other=0.0)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    if HEAD_NORM:
        inv = tl.rsqrt(tl.sum(af * af, 0) / HEAD_DIM + eps)
        wa = tl.load(norm_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        wb = tl.load(norm_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
        if NORM_OFFSET:
            af = _snap(af * inv * (1.0 + wa), a.dtype)
            bf = _snap(bf * inv * (1.0 + wb), a.dtype)
        else:
            af = _snap(_snap(af * inv, a.dtype) * wa, a.dtype)
            bf = _snap(_snap(bf * inv, a.dtype) * wb, a.dtype)
    return af, bf


@_jit
def _turn(a, b, cos_ptr, sin_ptr, offs_d, partner, rotated):
    """Element ``d`` and its partner's rotated by the rows at ``cos_ptr``/``sin_ptr`` (sin signed as
    :class:`~selfextend.core.rope.Rotation` keeps it: x * cos + swapped(x) * sin); past the rotary
    dimensions (``rotated`` False) they pass through."""
    c_d = tl.load(cos_ptr + offs_d, mask=rotated, other=1.0)
    s_d = tl.load(sin_ptr + offs_d, mask=rotated, other=0.0)
    c_p = tl.load(cos_ptr + partner, mask=rotated, other=1.0)
    s_p = tl.load(sin_ptr + partner, mask=rotated, other=0.0)
    return a * c_d + b * s_d, b * c_p + a * s_p


@_jit
def rope_write_kernel(
    qkv_ptr,
    q_ptr,
    qg_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    positions_ptr,
    pos_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    qcos_ptr,
    qsin_ptr,
    kcos_ptr,
    ksin_ptr,
    qn_ptr,
    kn_ptr,
    s_kh,
    s_kn,
    s_vh,
    s_vn,
    s_gh,
    s_gn,
    s_table,
    eps,
    n_heads,
    n_kv,
    HEAD_NORM: tl.constexpr,
    NORM_OFFSET: tl.constexpr,
    GROUPED: tl.constexpr,
    STORE_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One token's row ``qkv`` ((H + 2 Hkv) * D) after the projections, program ``i`` one head. A query
    head (``i < H``): normed (q_norm), rotated by the row's ``cos``/``sin``, rounded to ``q``'s type and
    stored; where ``GROUPED``, also turned by the query table's row at the position into ``qg`` (float32).
    A KV head: the key normed (k_norm), rotated, rounded to the model's then the cells' type and written at
    the cells' ``slot``, the value too; where ``STORE_G``, the stored key turned by the key table's row at
    the position and written into the grouped keys ``g`` (its grouped position, in the cells' type).
    Program 0 writes the cell's position. The position and the slot are read on the device (capturable)."""
    i = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    half = ROT_DIM // 2
    rotated = offs_d < ROT_DIM
    partner = tl.where(rotated, tl.where(offs_d < half, offs_d + half, offs_d - half), offs_d)
    pos = tl.load(pos_ptr)
    slot = tl.load(slot_ptr)
    if i == 0:
        tl.store(positions_ptr + slot, pos)
    if i < n_heads:
        a, b = _head(
            qkv_ptr + i * HEAD_DIM, offs_d, partner, d_ok, qn_ptr, eps, HEAD_NORM, NORM_OFFSET, HEAD_DIM
        )
        r_d, r_p = _turn(a, b, cos_ptr, sin_ptr, offs_d, partner, rotated)
        r_d = _round(r_d, q_ptr.dtype.element_ty)
        tl.store(q_ptr + i * HEAD_DIM + offs_d, r_d, mask=d_ok)
        if GROUPED:
            row = pos * s_table
            g_d, _ = _turn(
                r_d.to(tl.float32),
                _snap(r_p, q_ptr.dtype.element_ty),
                qcos_ptr + row,
                qsin_ptr + row,
                offs_d,
                partner,
                rotated,
            )
            tl.store(qg_ptr + i * HEAD_DIM + offs_d, g_d, mask=d_ok)
    else:
        j = (i - n_heads).to(tl.int64)  # (j * s_kh: past 2**31 elements in a long cache's later heads)
        src = qkv_ptr + (n_heads + j) * HEAD_DIM
        a, b = _head(src, offs_d, partner, d_ok, kn_ptr, eps, HEAD_NORM, NORM_OFFSET, HEAD_DIM)
        r_d, r_p = _turn(a, b, cos_ptr, sin_ptr, offs_d, partner, rotated)
        cell = k_ptr.dtype.element_ty
        r_d = _round(_snap(r_d, qkv_ptr.dtype.element_ty), cell)
        tl.store(k_ptr + j * s_kh + slot * s_kn + offs_d, r_d, mask=d_ok)
        v = tl.load(src + n_kv * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        tl.store(
            v_ptr + j * s_vh + slot * s_vn + offs_d,
            _round(v.to(tl.float32), v_ptr.dtype.element_ty),
            mask=d_ok,
        )
        if STORE_G:
            row = pos * s_table
            g_d, _ = _turn(
                r_d.to(tl.float32),
                _snap(_snap(r_p, qkv_ptr.dtype.element_ty), cell),
                kcos_ptr + row,
                ksin_ptr + row,
                offs_d,
                partner,
                rotated,
            )
            tl.store(g_ptr + j * s_gh + slot * s_gn + offs_d, _round(g_d, cell), mask=d_ok)
