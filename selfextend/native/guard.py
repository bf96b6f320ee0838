"""The one check every ctypes binding makes before it hands a tensor's address to C code.

C reads and writes through the address it is given whatever the tensor is: a meta tensor's address is
0 (a SIGSEGV), a CUDA tensor's is device memory, a float32 buffer read as bfloat16 is garbage, and a
buffer shorter than the count the C was told is memory past its end. :func:`address` refuses each
with a one-line ValueError and is a few attribute reads, cheap enough for the per-token calls.
"""

from __future__ import annotations

import torch


def address(t: torch.Tensor, dtype: torch.dtype, n: int, what: str, rows: int | None = None) -> int:
    """The address of ``t`` for C code that reads (or writes) ``n`` elements of ``dtype`` from it: ``t``
    on the CPU, of that very dtype, holding at least ``n`` elements, contiguous (with ``rows``: rows of
    ``rows`` elements contiguous, the outer axes at any stride, as the attention's cells are read);
    ValueError naming ``what`` otherwise."""
    fits = t.is_cpu and t.dtype == dtype and t.numel() >= n  # is_cpu: 5x faster than device.type
    if fits and rows is None:
        fits = t.is_contiguous()
    elif fits:
        strides = t.stride()
        fits = len(strides) >= 2 and strides[-1] == 1 and strides[-2] == rows == t.shape[-1]
    if not fits:
        raise ValueError(
            f"{what} reads {n} {'contiguous ' if rows is None else ''}{str(dtype).removeprefix('torch.')} "
            f"values on the CPU, not {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"
            f"{'' if rows is not None or t.is_contiguous() else ' (not contiguous)'}"
        )
    return t.data_ptr()
