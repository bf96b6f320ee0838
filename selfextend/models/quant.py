"""Products with a GGUF tensor's quantized blocks as stored (``quant.c``), for one row or a prefill chunk.

The kernel quantizes each activation row once per call to int8 blocks and takes integer dot products
with the weight's blocks, as llama.cpp does (AVX2, VNNI where compiled for, or a portable path), so a
token reads the file's own bytes. A row's result does not depend on how many rows the call holds. It is
built as the decode step's kernels are (:func:`selfextend.models.build.build`, into the same
cache); :class:`~selfextend.models.blocks.BlockLinear` calls it, whoever imports the model.
``$SELFEXTEND_QUANT_PORTABLE=1`` forces the portable path; ``$SELFEXTEND_NATIVE=0`` turns the kernel
off (the layers then use their reference product).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from selfextend.models.blocks import BLOCK_KINDS, INTERLEAVED, block_shape
from selfextend.models.build import TYPES, bind, kernels

SOURCE = Path(__file__).with_name("quant.c")
PORTABLE_ENV = "SELFEXTEND_QUANT_PORTABLE"
_OUT = {torch.float32: 0, torch.bfloat16: 1}


class QuantKernels:
    """The compiled ``quant_mm``; ``portable``: its scalar path, not the vector one."""

    def __init__(self, library: Path, portable: bool = False) -> None:
        self.library, self.portable = library, portable
        ptr, long, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        lib = ctypes.CDLL(str(library))
        self._mm = bind(lib.quant_mm, [i32, ptr, long, long, ptr, i32, long, ptr, i32, i32], i32)
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
        if kind not in BLOCK_KINDS and kind not in INTERLEAVED.values():
            raise ValueError(f"quant_mm computes GGUF types {sorted(BLOCK_KINDS)}, not {kind}")
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        x = x.reshape(-1, x.shape[-1]).contiguous()
        (m, k), n = x.shape, blocks.shape[0]
        values, size = block_shape(kind)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
            raise ValueError("quant_mm takes the blocks as contiguous (rows, bytes per row) uint8")
        if k % values or blocks.shape[1] != k // values * size:
            raise ValueError(f"quant_mm: rows of {k} values do not fit blocks of {blocks.shape[1]} bytes")
        if kind in INTERLEAVED.values() and n % 8:
            raise ValueError(f"quant_mm: an interleaved form holds rows in eights, not {n}")
        out = torch.empty(m, n, dtype=out_dtype)
        failed = self._mm(
            kind,
            blocks.data_ptr(),
            n,
            k,
            x.data_ptr(),
            TYPES[x.dtype],
            m,
            out.data_ptr(),
            _OUT[out_dtype],
            int(self.portable),
        )
        if failed:
            raise MemoryError(f"quant_mm: no scratch space for {m} rows of {k}")
        return out


@functools.cache
def quant_kernels() -> QuantKernels | None:
    """The kernel, built once per process (and once per machine on disk), or None where
    ``$SELFEXTEND_NATIVE`` is ``0`` or it cannot be built (then with one warning saying why)."""
    portable = os.environ.get(PORTABLE_ENV) == "1"
    return kernels(
        SOURCE, "quant", lambda library: QuantKernels(library, portable), "using the reference products"
    )
