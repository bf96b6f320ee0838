"""The decode step's native kernels (``decode.c``), built on first use and called through ctypes.

Why our own: a decode step on the CPU is a few hundred small operations per token, each a torch dispatch
of a few microseconds, around reads that torch's kernels do at a fraction of the bandwidth: SDPA reads a
layer's float32 cells at ~12 GB/s and bfloat16 ones at ~1.3 GB/s, ``_weight_int8pack_mm`` an int8 output
head at ~16 GB/s (``experiments/speed/native_bench.py``). ``decode.c`` has, per token and layer:

- attention that reads each KV head's cells once for all the query heads sharing it, in the cache's own
  type (float32, bfloat16 or float16), Self-Extend's grouped and neighbor scores in one pass, one
  softmax, split over torch's own OpenMP threads;
- the query and key normed (Qwen3's and Gemma 3's q/k norms) and rotated (the query on to its grouped
  position too), the key and value rounded and written into their cells, in one call;
- the RMSNorm before and the gated activation (SwiGLU, GeGLU) between the quantized products, handing
  them the bfloat16 row they take; a norm added to the residual (Gemma's norms after attention and MLP);
  and an int8 product of one row (the output head) at bandwidth.

It is compiled by :mod:`selfextend.native.build` (the system C compiler, ``-O3 -march=native``) into
``$SELFEXTEND_CACHE/kernels``, once per source, compiler and target; callers build it before they time
anything (:func:`native_kernels` at model load). Where no compiler works, :func:`native_kernels` returns
None and the step uses torch ops; ``SELFEXTEND_NATIVE=0`` asks for that too.

The wrappers check what the C code assumes (shapes, types, contiguity, sizes its stack rows hold) and
raise ValueError otherwise; the decode step checks once per plan and passes ``checked=True``.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

from selfextend.native.build import TYPES, bind, kernels
from selfextend.native.guard import address

F32, BF16 = torch.float32, torch.bfloat16

SOURCE = Path(__file__).with_name("decode.c")
MAX_QUERY_ROWS = 16  # query heads per KV head the kernel takes (decode.c's MAX_R)
MAX_HEAD_DIM = 256  # and head size (a multiple of 16; 8 * MAX_V8 there)
CELL_FIELDS = 15  # int64 values per layer and row of decode_layers' cells table (decode.c's R_FIELDS)
NO_MEMORY = 2  # what decode_attention returns without scratch space (1: sizes it cannot read)
GATED = {"silu": 0, "gelu_pytorch_tanh": 1}  # the gated activations decode.c computes, by transformers' names


class HeadNorms(NamedTuple):
    """The RMSNorms of each query and key head (Qwen3's and Gemma 3's q_norm, k_norm) as ``rope_write``
    applies them: the float32 factors (D,) they scale by and their epsilon."""

    query: torch.Tensor
    key: torch.Tensor
    eps: float

    def fits(self, d: int) -> bool:
        """Whether both are ``d`` contiguous float32 factors."""
        return all(
            w.shape == (d,) and w.dtype == torch.float32 and w.is_contiguous() for w in (self.query, self.key)
        )


class NativeKernels:
    """The compiled library's kernels. Calling it is attention: ``kernels(q, k, v, scale, grouped) ->
    (1, H, 1, D)`` float32, softmax(q . k * scale) . v for one query token of one sequence; with
    ``grouped = (q_g, k_g)`` the first ``k_g.shape[2]`` scores are q_g . k_g (Self-Extend's grouped keys)."""

    def __init__(self, library: Path) -> None:
        self.library = library
        lib = ctypes.CDLL(str(library))
        ptr, long, i32, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
        self._fn = bind(lib.decode_attention, [*[ptr] * 5, *[long] * 8, i32, f32, long, ptr], i32)
        self._write = bind(
            lib.rope_write,
            [ptr, *[long] * 4, *[ptr] * 4, *[long] * 3, i32, *[ptr] * 3, long, ptr, ptr, ptr, f32],
            None,
        )
        self._norm = bind(lib.rms_norm_bf16, [ptr, ptr, long, f32, ptr], None)
        self._norm_add = bind(lib.rms_norm_add, [ptr, i32, ptr, long, f32, ptr], None)
        self._gated = bind(lib.gated_bf16, [ptr, long, i32, ptr], None)
        self._gemv = bind(lib.int8_gemv, [ptr, ptr, ptr, long, long, long, ptr], i32)
        self._layers = bind(lib.decode_layers, [ptr, long, ptr, ptr, long, ptr, ptr], i32)

    @staticmethod
    def cell_type(cells: torch.Tensor) -> int:
        """How the C code numbers the element type of ``cells``."""
        return TYPES[cells.dtype]

    def decode_layers(
        self,
        plans: ctypes.Array,
        n_layers: int,
        dims: ctypes.Structure,
        cells: torch.Tensor,
        x: torch.Tensor,
        mm: int,
    ) -> int:
        """``decode.c``'s decode_layers over ``x`` (M, hidden) float32 in place, for
        :mod:`selfextend.generation.native_layers`, which builds its plans, sizes and ``cells`` table (int64);
        ``mm``: the address of quant.c's quant_mm. Returns its code (0 done, 1 no scratch space, 2 cells the
        attention does not read)."""
        if x.dim() != 2 or x.shape[1] != dims.hidden or len(plans) < n_layers:
            raise ValueError(
                f"decode_layers takes rows of {dims.hidden} for {len(plans)} layers, not {x.shape}"
            )
        m = x.shape[0]
        rows = address(x, F32, m * dims.hidden, "decode_layers' rows")
        table = address(cells, torch.int64, n_layers * m * CELL_FIELDS, "decode_layers' cells table")
        return self._layers(ctypes.addressof(plans), n_layers, ctypes.addressof(dims), table, m, rows, mm)

    def takes(self, heads: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the kernel reads cells ``k``, ``v`` (B, Hkv, n, D) for ``heads`` query heads: one sequence
        on the CPU, values shaped as the keys, rows contiguous, a type it knows, at most 16 query heads per KV
        head, a head size that is a multiple of 16 up to 256."""
        h, (b, hkv, _, d) = heads, k.shape
        return (
            b == 1
            and k.device.type == "cpu"
            and k.dtype in TYPES
            and v.dtype == k.dtype
            and v.shape == k.shape
            and h % hkv == 0
            and h // hkv <= MAX_QUERY_ROWS
            and d % 16 == 0
            and d <= MAX_HEAD_DIM
            and all(t.stride(-1) == 1 and t.stride(-2) == d for t in (k, v))
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        grouped: tuple[torch.Tensor, torch.Tensor] | None = None,
        checked: bool = False,
    ) -> torch.Tensor:
        """q (1, H, 1, D); k, v (1, Hkv, n, D) cell views, n >= 1; ``grouped``: q_g (1, H, 1, D) and k_g
        (1, Hkv, n_g, D), n_g <= n, read in the cells' type (a buffer of that type with contiguous rows is
        read in place: the cache keeps its grouped keys so).
        ``checked``: the caller has seen :meth:`takes` accept these cells' layout and made q and ``grouped``
        of these shapes (the decode step, once per token for every layer). ValueError otherwise."""
        if not checked:
            self._check_attention(q, k, v, grouped)
        if k.shape[2] < 1:
            raise ValueError("the attention kernel has no cells to attend (an empty cache)")
        _, h, _, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        q = q.float().contiguous()  # (1, H, 1, D) = (Hkv, H / Hkv, D) in memory
        cells = TYPES.get(k.dtype, -1)
        keys = address(k, k.dtype if cells >= 0 else F32, hkv * n * d, "the attention's keys", rows=d)
        vals = address(v, k.dtype, hkv * n * d, "the attention's values", rows=d)
        q_at = address(q, F32, h * d, "the attention's query")
        qg_at, kg_at, n_g, kg_stride = q_at, q_at, 0, 0
        if grouped is not None:
            q_g, k_g = grouped[0].float().contiguous(), grouped[1].to(k.dtype)
            if k_g.stride(-1) != 1 or k_g.stride(-2) != d:
                k_g = k_g.contiguous()
            n_g, kg_stride = k_g.shape[2], k_g.stride(1)
            qg_at = address(q_g, F32, h * d, "the attention's grouped query")
            kg_at = address(k_g, k.dtype, hkv * n_g * d, "the attention's grouped keys", rows=d)
        out = torch.empty_like(q)
        failed = self._fn(
            q_at,
            qg_at,
            keys,
            kg_at,
            vals,
            n,
            n_g,
            hkv,
            h // hkv,
            d,
            k.stride(1),
            kg_stride,
            v.stride(1),
            TYPES[k.dtype],
            scale,
            _chunks(hkv, n, torch.get_num_threads()),
            out.data_ptr(),
        )
        if failed == NO_MEMORY:
            raise MemoryError(f"decode attention kernel: no scratch space for {n} cells")
        if failed:
            raise ValueError(f"the attention kernel cannot read q {tuple(q.shape)}, k {tuple(k.shape)}")
        return out

    def _check_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        grouped: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """ValueError unless :meth:`__call__` can read these shapes and layouts."""
        fits = q.dim() == 4 and self.takes(q.shape[1], k, v)
        if fits:
            query = (1, q.shape[1], 1, k.shape[-1])
            fits = q.shape == query
            if grouped is not None:
                q_g, k_g = grouped
                fits = fits and q_g.shape == query and k_g.shape[:2] == k.shape[:2]
                fits = fits and k_g.shape[-1] == k.shape[-1] and k_g.shape[2] <= k.shape[2]
        if not fits:
            shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in (("q", q), ("k", k), ("v", v)))
            got = f"{shapes}, grouped {tuple(grouped[1].shape)}" if grouped is not None else shapes
            raise ValueError(f"the attention kernel cannot read {got} ({k.dtype})")

    def rope_write(
        self,
        qkv: torch.Tensor,
        heads: tuple[int, int],
        rotation: tuple[torch.Tensor, torch.Tensor],
        keys: torch.Tensor,
        values: torch.Tensor,
        slot: int,
        grouped: tuple[torch.Tensor, torch.Tensor] | None = None,
        checked: bool = False,
        norms: HeadNorms | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A token's query/key/value rows ``qkv`` (1, (H + 2 Hkv) * D) float32, ``heads`` = (H, Hkv): the
        key rotated and the value written to ``slot`` of the cells ``keys``, ``values`` (1, Hkv, capacity,
        D; rounded to their type); returns the rotated query (1, H, 1, D) float32 and, with ``grouped``,
        that query rotated on by it (Self-Extend's grouped query), else None. ``rotation``, ``grouped``:
        (cos, sin) factors of a :class:`~selfextend.core.rope.Rotation`, (rot_dim,) float32 each;
        ``norms``: each query and key head RMS-normed first; ``checked``: the caller has seen :meth:`takes`
        accept the cells, the norms fit and both rotations :func:`rotation_fits` (the C code's stack rows hold
        ``d`` floats); the slot is checked in any case."""
        h, hkv = heads
        d = keys.shape[-1]
        if qkv.dtype != torch.float32 or not qkv.is_contiguous() or qkv.numel() != (h + 2 * hkv) * d:
            raise ValueError(f"rope_write takes (1, {(h + 2 * hkv) * d}) float32, not {tuple(qkv.shape)}")
        if not ((checked or self.takes(h, keys, values)) and 0 <= slot < keys.shape[2]):
            raise ValueError(f"rope_write cannot write slot {slot} of cells {tuple(keys.shape)} {keys.dtype}")
        if not checked:
            if norms is not None and not norms.fits(d):
                raise ValueError(f"rope_write takes head norms of {d} contiguous float32 weights")
            for pair in (rotation,) if grouped is None else (rotation, grouped):
                if not rotation_fits(pair, d):
                    raise ValueError(f"rope_write takes (cos, sin) of the same even size <= {d}, float32")
        q = torch.empty(1, h, 1, d)
        q_g = torch.empty(1, h, 1, d) if grouped is not None else None
        (cos, sin), cells = rotation, hkv * keys.shape[2] * d
        gcos, gsin = grouped if grouped is not None else (cos, sin)
        rot, grot = cos.numel(), gcos.numel()
        self._write(
            address(qkv, F32, (h + 2 * hkv) * d, "rope_write's row"),
            h,
            hkv,
            d,
            rot,
            address(cos, F32, rot, "rope_write's cos"),
            address(sin, F32, rot, "rope_write's sin"),
            address(keys, keys.dtype if keys.dtype in TYPES else F32, cells, "rope_write's keys", rows=d),
            address(values, keys.dtype, cells, "rope_write's values", rows=d),
            keys.stride(1),
            values.stride(1),
            slot,
            TYPES[keys.dtype],
            q.data_ptr(),
            address(gcos, F32, grot, "rope_write's grouped cos"),
            address(gsin, F32, grot, "rope_write's grouped sin"),
            grot,
            None if q_g is None else q_g.data_ptr(),
            None if norms is None else address(norms.query, F32, d, "rope_write's query norm"),
            None if norms is None else address(norms.key, F32, d, "rope_write's key norm"),
            0.0 if norms is None else norms.eps,
        )
        return q, q_g

    def rms_norm_bf16(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """An RMSNorm ``weight * x / rms(x)`` of one row ``x`` (1, n) float32 by ``weight`` (n,) float32 (the
        factor it scales by: Gemma's ``1 + weight``), rounded to bfloat16 (the input of the quantized product
        after it)."""
        n = weight.shape[0] if weight.dim() == 1 else -1
        if x.shape != (1, n):
            raise ValueError(f"rms_norm_bf16 takes one row of its {n} factors, not {tuple(x.shape)}")
        at = address(x, F32, n, "rms_norm_bf16's row")
        factors = address(weight, F32, n, "rms_norm_bf16's factors")
        out = torch.empty(1, n, dtype=torch.bfloat16)
        self._norm(at, factors, n, eps, out.data_ptr())
        return out

    def rms_norm_add(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """``x += weight * y / rms(y)`` in place, for rows ``x`` (1, n) float32 and ``y`` (1, n) float32 or
        bfloat16 (a quantized product's output): Gemma's norm of an attention or MLP output, then the
        residual add."""
        n = weight.shape[0] if weight.dim() == 1 else -1
        if not x.shape == y.shape == (1, n):
            raise ValueError(
                f"rms_norm_add takes rows of its {n} factors: {tuple(x.shape)}, {tuple(y.shape)}"
            )
        added = address(y, BF16 if y.dtype == BF16 else F32, n, "rms_norm_add's normed row")
        factors = address(weight, F32, n, "rms_norm_add's factors")
        self._norm_add(added, TYPES[y.dtype], factors, n, eps, address(x, F32, n, "rms_norm_add's residual"))

    def gated_bf16(self, gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """``act(gate) * up`` for one row ``gate_up`` = [gate, up] (1, 2n) bfloat16, computed in float32 and
        rounded to bfloat16 (1, n); ``activation`` one of :data:`GATED`."""
        if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
            raise ValueError(f"gated_bf16 takes one row of gate and up, not {tuple(gate_up.shape)}")
        if activation not in GATED:
            raise ValueError(f"gated_bf16 computes {', '.join(GATED)}, not {activation!r}")
        n = gate_up.shape[-1] // 2
        at = address(gate_up, BF16, 2 * n, "gated_bf16's row")
        out = torch.empty(1, n, dtype=torch.bfloat16)
        self._gated(at, n, GATED[activation], out.data_ptr())
        return out

    def int8_gemv(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``(x . weight^T) * scale`` for rows ``x`` (M, K) (taken as bfloat16), ``weight`` (N, K) int8 and
        ``scale`` (N,) bfloat16, out (M, N) bfloat16: torch's ``_weight_int8pack_mm``, which reads a large
        weight (an output head) at a third of the bandwidth (experiments/speed/native_bench.py). The weight is
        read once for all rows, and each row's output is the one it gets alone (batched decoding)."""
        if weight.dim() != 2:
            raise ValueError(f"int8_gemv takes a weight of (rows, columns), not {tuple(weight.shape)}")
        n, k = weight.shape
        x = x.to(torch.bfloat16)
        if x.dim() != 2 or x.shape[1] != k or scale.numel() != n:
            raise ValueError(
                f"int8_gemv takes rows of {k} and {n} scales, not {tuple(x.shape)}, {scale.numel()}"
            )
        m = x.shape[0]
        rows = address(x, BF16, m * k, "int8_gemv's rows")
        w = address(weight, torch.int8, n * k, "int8_gemv's weight")
        scales = address(scale, BF16, n, "int8_gemv's scales")
        out = torch.empty(m, n, dtype=torch.bfloat16)
        if self._gemv(rows, w, scales, m, n, k, out.data_ptr()):
            raise MemoryError(f"int8_gemv: no scratch space for {m} rows of {k}")
        return out


def rotation_fits(rotation: tuple[torch.Tensor, torch.Tensor], d: int) -> bool:
    """Whether ``(cos, sin)`` are what ``rope_write`` reads for head size ``d``: contiguous float32 factors of
    one even size (rot_dim) of at most ``d``."""
    cos, sin = rotation
    return (
        cos.dtype == sin.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.numel() == sin.numel() <= d
        and cos.numel() % 2 == 0
    )


def _chunks(hkv: int, n: int, threads: int) -> int:
    """Pieces each KV head's cells are cut into: the fewest that give every thread the same number of
    (head, piece) tasks, while a piece keeps at least 64 cells."""
    chunks = 1
    while (hkv * chunks) % threads and chunks < threads:
        chunks += 1
    return max(1, min(chunks, n // 64))


@functools.cache
def native_kernels() -> NativeKernels | None:
    """The kernels, built once per process (and once per machine on disk), or None where
    ``$SELFEXTEND_NATIVE`` is ``0`` or they cannot be built (then with one warning saying why)."""
    missing = "native decode kernels not built ({reason}); decoding through torch ops"
    return kernels(SOURCE, "native", NativeKernels, missing)
