"""Which decode step writes a model's tokens: the one gate generate, chat and serve go through.

The step's math is described twice, side by side, and the tests hold each to the model's own forward:

- :class:`~selfextend.generation.decode.DecodeStep` reads the model's modules per layer and row; on the
  CPU its products, norms and attention are the native kernels (every layer in one native call where all
  are GGUF blocks, :mod:`~selfextend.generation.native_layers`), elsewhere torch's ops. It takes several
  rows in one pass (a speculative check's drafts, a server's slots), the rows' logits those of stepping
  each alone where the products are batch-invariant.
- :class:`~selfextend.generation.compiled.CompiledStep` is one decoder layer in plain tensor ops with
  positions as tensors, so it compiles (:class:`~selfextend.generation.compiled.FastDecode`, asked for with
  ``--compile``) and, over every cell with static shapes, is captured as a CUDA graph
  (:class:`~selfextend.generation.graphed.GraphedDecode`, whose attention is the fused Triton kernel).

:func:`decode_backends` picks by device and model: the direct step for rows wherever it serves the model,
and for single tokens first the compiled step where asked, else the captured one on a GPU. A model neither
serves (another family, accelerate's device map) runs through its own forward.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from selfextend.core.fused_prefill import kernels_run_on
from selfextend.generation.compiled import FastDecode, fast_decode_for
from selfextend.generation.decode import DecodeStep, decode_step_for
from selfextend.generation.graphed import GraphedDecode, graphed_decode_for


class DecodeBackends(NamedTuple):
    """``rows``: one pass over several rows (single tokens too); ``single``: tried first for a single
    token, None where it serves none (it may also decline a token: the caller then uses ``rows``)."""

    rows: DecodeStep | None
    single: FastDecode | None


def weight_owners(model: nn.Module, single: FastDecode | None) -> list[nn.Module]:
    """The modules whose tensors the steps hold on to: every module where the single-token step is a
    captured one (a CUDA graph replays the addresses it read, which a replaced tensor may free) or float
    projections are fused (on a GPU, or under Triton's interpreter: the fused layer holds their values);
    none elsewhere (the CPU's steps read the modules as they are at each call). Their
    :func:`~selfextend.generation.decode.tensors_key` changes when a weight is replaced
    (``module.weight = ...``, ``model.to(...)``): the steps are then made again."""
    held = isinstance(single, GraphedDecode) or kernels_run_on(next(model.parameters()).device)
    return list(model.modules()) if held else []


def decode_backends(model: nn.Module, direct: bool = True, compile: bool = False) -> DecodeBackends:
    """The steps for ``model`` (``direct`` False: none, every token through the model's forward;
    ``compile``: single tokens through ``torch.compile``'s step where it serves the model)."""
    rows = decode_step_for(model) if direct else None
    single = fast_decode_for(model) if compile else None
    if single is None and direct:
        single = graphed_decode_for(model)  # None off a GPU
    return DecodeBackends(rows, single)
