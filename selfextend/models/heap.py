"""The process's C heap: freed pages handed back to the system, and growth bounded for a long-running server.

Only glibc's ``malloc_trim`` and ``mallopt`` (through ctypes) and environment variables; nothing elsewhere.
Loading a model (:mod:`selfextend.models.weights`), benchmarks between runs and the server after each
request call :func:`release_free_memory`; ``serve`` calls :func:`bound_heap_growth` once at start.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    Why: converting a tensor frees its float32 temporaries and keeps its smaller run form in between,
    and parsing a GGUF's metadata frees hundreds of MB of small objects. glibc keeps freed heap memory
    resident (spread over the arenas of torch's worker threads, pinned by the tensors kept), so without
    this the peak of a conversion varies from run to run by a good part of the run form's size
    (``experiments/memory/load_cost.py`` measures it).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters
MMAP_THRESHOLD = 8 * 2**20  # blocks this large and larger get mappings of their own (bound_heap_growth)
TRIM_THRESHOLD = 64 * 2**20  # free memory kept at the top of the heap between frees
ONEDNN_CACHE = 16  # oneDNN primitives kept per thread by torch's ideep (its default: 1024)


def bound_heap_growth(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> None:
    """For a long-running process that runs prompts of every length (the server): keep its resident memory
    from creeping up request after request, without making each decoded token pay for it. Only glibc's
    ``mallopt`` and an environment variable.

    - blocks of ``mmap_threshold`` bytes and more (a prompt's activations) get their own mappings, handed
      back when freed: glibc otherwise raises its threshold up to 32 MiB as large blocks are freed and
      then serves such tensors from heaps whose free pages stay resident between live blocks;
    - smaller blocks come from the heap, whose free top is kept up to ``trim_threshold`` bytes (the
      server trims it after each request, :func:`release_free_memory`), so a token's temporaries (the
      logits, top-k's 4 MiB working buffer over a 262k vocabulary) reuse pages already mapped. A 64 KiB
      threshold mapped and faulted them in again every token: Gemma 3 served 62.5 tokens/s sampled
      against 79.1 (``experiments/server/server_decode.py``);
    - one heap (arena) for all threads, which :func:`release_free_memory` trims from the top too;
    - at most :data:`ONEDNN_CACHE` oneDNN primitives cached per thread (one is built per matrix shape, and
      every prompt length is a new shape), unless ``$LRU_CACHE_CAPACITY`` says otherwise; read by
      torch when a thread first runs a oneDNN product, so call this before the model runs.

    A setting given in the environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
    ``MALLOC_ARENA_MAX``, ``LRU_CACHE_CAPACITY``) is left as it is.
    """
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(ONEDNN_CACHE))
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        mallopt(M_MMAP_THRESHOLD, mmap_threshold)
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        mallopt(M_TRIM_THRESHOLD, trim_threshold)
    if "MALLOC_ARENA_MAX" not in os.environ:
        mallopt(M_ARENA_MAX, 1)
