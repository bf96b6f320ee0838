"""The read-bandwidth probe's binding (``stream.c``): the figure every GB/s of a decode is read against.

One ``torch.sum`` over a large tensor (the probe before) is a single reduction whose loop, not the memory,
can set the pace, and one reading of a shared host's memory moves with its other tenants: a decode was seen
reading more than the probe said the machine could. ``stream.c`` reads as STREAM does (each thread its own
part, independent vector accumulators, best of several passes); callers take it before and after each
timed run and report the range.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from selfextend.native.build import bind, kernels
from selfextend.native.guard import address

SOURCE = Path(__file__).with_name("stream.c")


class StreamProbe:
    """``probe(mib, passes) -> GB/s``: the best pass reading a float32 buffer of ``mib`` MiB with torch's
    current thread count (the buffer is made once per size and kept)."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        self._read = bind(
            lib.stream_read_seconds,
            [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.POINTER(ctypes.c_float)],
            ctypes.c_double,
        )
        self._buffers: dict[int, torch.Tensor] = {}

    def __call__(self, mib: int = 512, passes: int = 5) -> float:
        if mib < 1 or passes < 1:
            raise ValueError(f"the probe reads at least 1 MiB once, not {mib} MiB {passes} times")
        x = self._buffers.get(mib)
        if x is None:
            x = self._buffers[mib] = torch.ones(mib * 2**20 // 4)  # pages touched once, here
        sink = ctypes.c_float()
        seconds = self._read(address(x, torch.float32, x.numel(), "stream_read"), x.numel(), passes, sink)
        return x.numel() * 4 / seconds / 1e9


@functools.cache
def stream_probe() -> StreamProbe | None:
    """The probe, built once per process (and once per machine on disk), or None where
    ``$SELFEXTEND_NATIVE`` is ``0`` or it cannot be built (then with one warning saying why)."""
    return kernels(
        SOURCE, "stream", StreamProbe, "read-bandwidth probe not built ({reason}); torch's sum instead"
    )
