"""The KV cache's element type and the decode path a model runs with, from the command line's choices
(``--cache-type``, ``--compile``): one policy for generate, chat, serve and bench."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from selfextend.core.validate import ValidationError
from selfextend.generation import compiled, decode, graphed
from selfextend.native.decode import native_kernels

CACHE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}  # llama.cpp's names
NATIVE_CACHE_TYPE = "bf16"  # the default where the native decode step runs (default_cache_dtype)


def default_cache_dtype(model: nn.Module) -> torch.dtype | None:
    """The KV cache's element type when none is asked for and the step is not compiled: bfloat16 where
    :func:`native_cells_default` holds for ``model`` as it runs (and its module layout is the direct step's),
    else None, the model's dtype."""
    param = next(model.parameters())
    native = decode.layout_problem(model) is None and native_cells_default(
        model.config, param.device, param.dtype
    )
    return CACHE_DTYPES[NATIVE_CACHE_TYPE] if native else None


def native_cells_default(config: Any, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a model of ``config`` run in ``dtype`` on ``device`` gets bf16 cells by default: a float32
    model that the direct :class:`~selfextend.generation.decode.DecodeStep` decodes on the CPU with its native
    kernels (which read bf16 cells as stored, plain or Self-Extend: side by side in
    ``python experiments/speed/decode_paths.py direct:f32 direct:bf16``, 0.93-0.95x the time of f32 cells, for
    half the memory; perplexity +0.03%, README). Elsewhere the cells are in the model's dtype (torch's bf16
    CPU attention is slower than its float32 one: bf16 cells would halve the speed there)."""
    direct = torch.device(device).type == "cpu" and dtype == torch.float32
    return direct and decode.config_problem(config) is None and native_kernels() is not None


def decode_settings(
    model: nn.Module, compile: bool | None = None, cache_type: str | None = None
) -> tuple[bool, torch.dtype | None]:
    """(compile, KV cache dtype) from the command-line choices, None meaning the default: compile where it
    pays (:func:`~selfextend.generation.compiled.compile_pays`), never where the step is captured as a
    CUDA graph (a model on a GPU: asked for there, it is said once and not done); the cache in the model's
    dtype with the compiled step (slower over bf16 and f16 cells than over f32), else
    :func:`default_cache_dtype` (``model`` as it will run). What the reduced types cost in perplexity and
    K-shift drift is in the README (``experiments/quality/cache_type_ppl.py``,
    ``experiments/quality/decode_cache_nll.py``)."""
    compile = compiled.compile_pays(model) if compile is None else compile
    if compile and graphed.graphed_serves(model):  # a model on a GPU: the captured step runs there
        compiled._stderr(
            "note: --compile is for the CPU: on a GPU the decode step is captured as a CUDA graph instead "
            "(with the fused kernels; torch.compile's step would launch its kernels from Python each token)"
        )
        compile = False
    if cache_type is None:
        return compile, None if compile else default_cache_dtype(model)
    if cache_type not in CACHE_DTYPES:
        raise ValidationError("cache type", f"must be one of {', '.join(CACHE_DTYPES)}, got {cache_type!r}")
    return compile, CACHE_DTYPES[cache_type]
