"""Products with a GGUF tensor's quantized blocks as stored (``quant.c``), for one row or a prefill chunk.

The kernel quantizes each activation row once per call to int8 blocks and takes integer dot products
with the weight's blocks, as llama.cpp does (AVX2, VNNI where compiled for, or a portable path), so a
token reads the file's own bytes. A row's result does not depend on how many rows the call holds. It is
built as the decode step's kernels are (:func:`selfextend.native.build.build`, into the same
cache); :class:`~selfextend.models.blocks.BlockLinear` calls it, whoever imports the model.
``$SELFEXTEND_QUANT_PORTABLE=1`` forces the portable path; ``$SELFEXTEND_NATIVE=0`` turns the kernel
off (the layers then use their reference product).

A prefill chunk can go another way (:func:`chunk_engine`): ``bf16`` dequantizes the weight a tile of rows
at a time to bfloat16 and multiplies through torch (oneDNN, which runs AMX tiles where the CPU has them);
``int8`` is the integer products above. Where AMX runs, bf16 is 2.3-3.4x int8 for a 512-row chunk (a
2-core Xeon with AMX: ``experiments/speed/prefill_engines.py``), so ``auto`` picks it there and int8
elsewhere. Only int8 keeps a row's result independent of the rows beside it (bf16 is used from
:data:`~selfextend.models.blocks.BF16_MIN_ROWS` rows on), which is why the server keeps int8.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from selfextend.native.blocktypes import BLOCK_KINDS, INTERLEAVED, block_shape, c_header, c_sources
from selfextend.native.build import TYPES, Sources, bind, kernels
from selfextend.native.guard import address

SOURCE = Sources(c_sources(), (("blocktypes.h", c_header()),))  # the driver, each family's loops, the table
PORTABLE_ENV = "SELFEXTEND_QUANT_PORTABLE"
ENGINE_ENV = "SELFEXTEND_PREFILL"  # auto, int8 or bf16: how prefill chunks multiply (chunk_engine)
ENGINES = ("auto", "int8", "bf16")
TILE_VALUES = 1 << 22  # weight values dequantized at a time for the bf16 engine (8 MiB of bfloat16)
_OUT = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def amx_present() -> bool:
    """Whether this CPU runs AMX tiles, as torch finds (the instructions, and the kernel's permission)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check is not None and check())


def chunk_engine(setting: str | None = None, default: str = "auto") -> str:
    """``int8`` or ``bf16``, the engine prefill chunks use: ``setting``, else ``$SELFEXTEND_PREFILL``, else
    ``default``; ``auto`` is bf16 where the CPU has AMX and int8 elsewhere. ValueError for another name."""
    value = (setting or os.environ.get(ENGINE_ENV) or default).strip().lower()
    if value not in ENGINES:
        raise ValueError(f"prefill engine '{value}' (${ENGINE_ENV}): name auto, int8 or bf16")
    if value == "auto":
        return "bf16" if amx_present() else "int8"
    return value


class QuantKernels:
    """The compiled ``quant_mm``; ``portable``: its scalar path, not the vector one."""

    def __init__(self, library: Path, portable: bool = False) -> None:
        self.library, self.portable = library, portable
        ptr, long, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        lib = ctypes.CDLL(str(library))
        check = getattr(lib, "quant_check", None)  # an older quant.c (row_products.py --against) lacks it
        missing = 0 if check is None else bind(check, [], i32)()
        if missing:
            raise RuntimeError(f"{library.name} has no loops for GGUF type {missing} of blocktypes.py")
        self._mm = bind(lib.quant_mm, [i32, ptr, long, long, ptr, i32, long, ptr, i32, i32], i32)
        self._dequant = bind(lib.quant_dequant_bf16, [i32, ptr, long, long, ptr], i32)
        # an older quant.c built to be timed beside this one (experiments/speed/row_products.py --against)
        # lacks it
        rows, x8 = getattr(lib, "quant_rows_f32", None), getattr(lib, "quant_rows_x8_f32", None)
        self._rows = None if rows is None else bind(rows, [i32, ptr, long, long, ptr, long, long, ptr], i32)
        self._rows_x8 = None if x8 is None else bind(x8, [i32, ptr, long, long, ptr, long, long, ptr], i32)
        interleaves = getattr(lib, "quant_interleaves", None)  # and this
        ready = getattr(lib, "amx_ready", None)  # and this
        # whether several rows of the 32-value interleaved forms go through AMX int8 tiles here (amx.c)
        self.amx = ready is not None and not portable and bind(ready, [], i32)() == 1
        self._interleaves = None if interleaves is None else bind(interleaves, [i32], i32)
        self.address = ctypes.cast(
            self._mm, ctypes.c_void_p
        ).value  # for C code that calls it (decode_layers)

    def __call__(
        self, x: torch.Tensor, blocks: torch.Tensor, kind: int, out_dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``x (M, K) @ W^T -> (M, N)`` in ``out_dtype`` (float32 or bfloat16) for W the GGUF blocks
        ``blocks`` (N, bytes per row) uint8 of type ``kind`` (one of :data:`BLOCK_KINDS`, or an 8-row
        interleaved form of :data:`~selfextend.models.blocks.INTERLEAVED`); ``x`` float32 or bfloat16
        (others are taken as float32). ValueError for shapes that do not fit."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        w = _check(blocks, kind, x.shape[-1])
        x = x.reshape(-1, x.shape[-1]).contiguous()
        (m, k), n = x.shape, blocks.shape[0]
        out = torch.empty(m, n, dtype=out_dtype)
        failed = self._mm(
            kind,
            w,
            n,
            k,
            address(x, x.dtype, m * k, "quant_mm's rows"),
            TYPES[x.dtype],
            m,
            out.data_ptr(),
            _OUT[out_dtype],
            int(self.portable),
        )
        if failed:
            raise MemoryError(f"quant_mm: no scratch space for {m} rows of {k}")
        return out

    def interleaves(self, kind: int) -> bool:
        """Whether layers hold GGUF type ``kind`` in its 8-row interleaved form (:data:`INTERLEAVED`): it has
        one and its products run faster on it than on the stored rows with this build on this CPU (the
        K-quants' AVX-512 loops on a Xeon keep the stored rows, as measured there)."""
        if kind not in INTERLEAVED:
            return False
        return self._interleaves is None or bool(self._interleaves(kind))

    def dequantize(self, blocks: torch.Tensor, kind: int, n_in: int) -> torch.Tensor:
        """(N, n_in) bfloat16: the weight rows of ``blocks`` of type ``kind`` (as :meth:`__call__` takes
        them), each value gguf's dequantisation rounded to nearest even. ValueError for shapes that do
        not fit."""
        w = _check(blocks, kind, n_in)
        out = torch.empty(blocks.shape[0], n_in, dtype=torch.bfloat16)
        if self._dequant(kind, w, blocks.shape[0], n_in, out.data_ptr()):
            raise MemoryError(f"quant_dequant_bf16: no scratch space for rows of {n_in}")
        return out

    def rows(self, blocks: torch.Tensor, kind: int, n_in: int, ids: torch.Tensor) -> torch.Tensor:
        """(len(ids), n_in) float32: rows ``ids`` (int64) of the blocks of type ``kind`` (stored, or an
        interleaved form: row r is lane r % 8 of group r // 8, ``rows.c``), gguf's dequantized values of
        the stored rows bit for bit, all in one call. ValueError for shapes that do not fit and for an id
        outside the rows the blocks hold (the C checks them too: it is given their count)."""
        w = _check(blocks, kind, n_in)
        lookup = self._rows_x8 if kind in INTERLEAVED.values() else self._rows
        if lookup is None:
            raise RuntimeError(f"{self.library.name} has no row lookups for GGUF type {kind} (older sources)")
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        n_rows, n = blocks.shape[0], ids.shape[0]
        out = torch.empty(n, n_in)
        at = address(ids, torch.int64, n, "the row lookup's ids")
        failed = lookup(kind, w, blocks.shape[1], n_rows, at, n, n_in, out.data_ptr())
        if failed == 1:
            raise MemoryError(f"quant_rows_x8_f32: no scratch space for a group of rows of {n_in}")
        if failed == 3:
            raise ValueError(f"token ids must lie in [0, {n_rows}) (the table's rows), got {_span(ids)}")
        if failed:
            raise ValueError(f"GGUF type {kind} rows of {n_in} values are not looked up")
        return out

    def tiled(self, x: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
        """``x (M, K) @ W^T -> (M, N)`` float32 by the bf16 engine: ``x`` rounded to bfloat16, W
        dequantized :data:`TILE_VALUES` values at a time (:meth:`dequantize`), each tile's product by
        torch (oneDNN: AMX where present), its bfloat16 result widened into the output."""
        _check(blocks, kind, x.shape[-1])
        x = x.reshape(-1, x.shape[-1]).bfloat16()
        (m, k), n = x.shape, blocks.shape[0]
        per = max(8, TILE_VALUES // k // 8 * 8)  # whole groups of 8 for an interleaved form
        out = torch.empty(m, n)
        for a in range(0, n, per):
            w = self.dequantize(blocks[a : a + per], kind, k)  # (rows, K)
            out[:, a : a + w.shape[0]] = x @ w.T
        return out


def _span(ids: torch.Tensor) -> str:
    return f"{int(ids.min())}..{int(ids.max())}" if ids.numel() else "none"


def _check(blocks: torch.Tensor, kind: int, k: int) -> int:
    """The address of ``blocks``; ValueError where they are not (N, bytes per row) uint8 of ``kind`` for rows
    of ``k`` values, contiguous on the CPU (:func:`~selfextend.native.guard.address`)."""
    if kind not in BLOCK_KINDS and kind not in INTERLEAVED.values():
        raise ValueError(f"quant_mm computes GGUF types {sorted(BLOCK_KINDS)}, not {kind}")
    values, size = block_shape(kind)
    if blocks.dim() != 2:
        raise ValueError(f"quant_mm takes the blocks as (rows, bytes per row), not {tuple(blocks.shape)}")
    if k < 1 or blocks.shape[0] < 1:
        raise ValueError(f"quant_mm takes weights of a row and a value or more, not {blocks.shape[0]}x{k}")
    if blocks.dtype != torch.uint8 or not blocks.is_contiguous():
        raise ValueError("quant_mm takes the blocks as contiguous (rows, bytes per row) uint8")
    if k % values or blocks.shape[1] != k // values * size:
        raise ValueError(f"quant_mm: rows of {k} values do not fit blocks of {blocks.shape[1]} bytes")
    if kind in INTERLEAVED.values() and blocks.shape[0] % 8:
        raise ValueError(f"quant_mm: an interleaved form holds rows in eights, not {blocks.shape[0]}")
    return address(blocks, torch.uint8, blocks.shape[0] * blocks.shape[1], "quant_mm's blocks")


@functools.cache
def quant_kernels() -> QuantKernels | None:
    """The kernel, built once per process (and once per machine on disk), or None where
    ``$SELFEXTEND_NATIVE`` is ``0`` or it cannot be built (then with one warning saying why)."""
    portable = os.environ.get(PORTABLE_ENV) == "1"
    return kernels(
        SOURCE,
        "quant",
        lambda library: QuantKernels(library, portable),
        "GGUF block products not built ({reason}); using the reference products",
    )
