"""A decode step that ``torch.compile`` takes: one graph for every layer, fill, shift and Self-Extend group.

The step reads the model's modules and writes each layer's new key and value into the cache's cells
(:func:`~selfextend.generation.layer.layer_rows`); attention is
:func:`~selfextend.generation.step_attention.attend`, plain tensor ops the compiler fuses, which cells a
query sees coming from their positions. Shapes that change from token to token (the cells in use) are
dynamic and positions are tensors, so a context shift (done by the cache, outside the step) and
Self-Extend's grouping never change the graph. Families: Llama, Mistral, Qwen2, Qwen3 and Gemma 3. What is
compiled is one decoder layer, called for every layer with its weights: all layers share its graph (one
per kind of attention: sliding, full, grouped), so the first compile traces one layer, not the model. Run
eagerly for one row, an int8 output head is the native one (native/decode.py).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config

from selfextend.core.fused_step import fused_step_applies
from selfextend.generation.cells import Cells, StepCells
from selfextend.generation.decode import ATTENTION, fuse_projections, why_not
from selfextend.generation.layer import LayerCells, add_norm, layer_rows
from selfextend.generation.products import direct, product_of
from selfextend.generation.rotary import rope_by_kind, rotations_at
from selfextend.generation.step_attention import GroupedRotations
from selfextend.hf.facts import layer_kinds, sliding_windows
from selfextend.hf.patch import IMPLEMENTATION, SelfExtendParams
from selfextend.kv.cache import ContextShiftCache
from selfextend.models.sources import cache_root
from selfextend.native.decode import native_kernels

RECOMPILE_LIMIT = 64  # graphs of the layer function per process (dynamo's default, 8, is per code object)


def compile_pays(model: nn.Module) -> bool:
    """Whether compiling the step is the default for ``model``: only where ``$SELFEXTEND_COMPILE`` is ``1``,
    on CPU, for a family it serves (the eager native step is faster; ``--compile`` asks for it anyway)."""
    if os.environ.get("SELFEXTEND_COMPILE") != "1":
        return False
    return next(model.parameters()).device.type == "cpu" and why_not(model) is None


class CompiledStep:
    """``step(token, pos, cells, grouped) -> logits``: the decode step, each layer through :attr:`layer_fn`.

    ``cells``: each layer's buffers, the positions of the slots the query may see (the new token's slot
    among them, at position ``pos``) and the slot where this token's key and value are written
    (:class:`~selfextend.generation.cells.Cells`). ``grouped``: per layer the Self-Extend tables, or None.
    :meth:`rows` is the same step for B sequences at once (the batched decode of
    :mod:`selfextend.generation.batched`).
    """

    def __init__(self, model: nn.Module) -> None:
        reason = why_not(model)
        if reason:
            raise ValueError(f"CompiledStep does not support this model ({reason})")
        self.config = model.config  # not the model: a step cached per model must not keep it alive
        inner = model.model
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.layers = list(inner.layers)
        self.attentions = [m.self_attn for m in self.layers]  # (read each token: no Module.__getattr__)
        self.head = model.lm_head
        config = model.config.get_text_config()
        self.kinds = layer_kinds(model)
        self.windows = sliding_windows(config)
        self.rope_by_kind = rope_by_kind(self.rotary)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.qkv = [
            fuse_projections([a.q_proj, a.k_proj, a.v_proj]) for a in (m.self_attn for m in self.layers)
        ]
        self.gate_up = [fuse_projections([m.mlp.gate_proj, m.mlp.up_proj]) for m in self.layers]
        self.layer_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = layer_rows
        self.head_row = (
            product_of((self.head,), native_kernels(), logits=True) if direct((self.head,)) else None
        )

    def supported(self) -> bool:
        """Whether the model's current attention implementation is one this step computes."""
        return self.config._attn_implementation in ATTENTION

    def self_extend(self) -> list[SelfExtendParams | None]:
        """Each layer's Self-Extend parameters under the ``selfextend`` attention, else None."""
        if self.config._attn_implementation != IMPLEMENTATION:
            return [None] * len(self.layers)
        found = [vars(a).get("self_extend") for a in self.attentions]
        return [p if isinstance(p, SelfExtendParams) else None for p in found]

    def __call__(
        self, token: torch.Tensor, pos: torch.Tensor, cells: Cells, grouped: list[GroupedRotations | None]
    ) -> torch.Tensor:
        """Logits (vocab,) after ``token`` (1, 1) at position ``pos`` (1,); writes its cells."""
        return self.rows(token, pos, [cells], grouped)[0]

    def rows(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        cells: list[Cells],
        grouped: list[GroupedRotations | None],
    ) -> torch.Tensor:
        """Logits (B, vocab) after ``tokens`` (B, 1), row ``b`` at position ``pos[b]`` of its own cache's
        ``cells[b]``; writes each row's cells. The products take the B rows together (the weights read once
        for all); attention runs per row over its cells. ``grouped`` serves every row (by position). Each
        layer goes through :attr:`layer_fn` (:func:`layer_rows`, or its compiled form)."""
        x = self.embed(tokens)  # (B, 1, hidden)
        rotations = rotations_at(self.rotary, self.kinds, self.rope_by_kind, x, pos)
        pending = torch.zeros_like(
            x
        )  # what the layer before left to add (a tensor for every layer: one graph)
        for i, layer in enumerate(self.layers):
            layer_cells = [
                LayerCells(
                    c.keys[i], c.values[i], c.positions[i], c.slots[i : i + 1], c.grouped and c.grouped[i]
                )
                for c in cells
            ]
            x, pending = self.layer_fn(
                layer,
                self.qkv[i],
                self.gate_up[i],
                x,
                rotations[self.kinds[i]],
                pos,
                layer_cells,
                self.windows[i],
                grouped[i],
                pending,
            )
        _, h = add_norm(self.norm, x, pending, fused_step_applies(x))
        if self.head_row is not None and x.shape[0] == 1:  # (the head is never inside a compiled graph)
            logits = self.head_row(h.view(1, -1)).to(x.dtype)  # (1, hidden) -> (1, vocab)
        else:
            logits = self.head(h)[:, -1]  # (B, vocab)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def frequencies(params: list[SelfExtendParams | None]) -> list[torch.Tensor | None]:
    """Each layer's inverse frequencies as its Self-Extend ``params`` read them now, each rotary module's
    read once (every layer of most models shares one: a decode token's host time is the token's too)."""
    seen: dict[tuple[int, str], torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    for p in params:
        if p is None:
            out.append(None)
            continue
        where = (id(p.rotary.module), p.rotary.attr)
        if where not in seen:
            seen[where] = p.inv_freq
        out.append(seen[where])
    return out


def no_duck_shapes() -> AbstractContextManager:
    """While compiling: no equality guards between dimensions that happen to be equal at the first call
    (a full and a sliding layer's cells in use), which would recompile when they part."""
    return fx_config.patch(use_duck_shape=False)


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled graphs: ``$TORCHINDUCTOR_CACHE_DIR`` where the user set it, else
    ``inductor`` under the selfextend cache root. Importing parts of torch writes torch's own default into
    that variable, so a value equal to torch's default counts as not set."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) != os.path.abspath(default_cache_dir()):
        return given
    return str(cache_root() / "inductor")


def _stderr(message: str) -> None:
    """Where a step's notices go by default."""
    print(message, file=sys.stderr, flush=True)


class FastDecode:
    """``fast(token, cache) -> logits | None``: one token through :class:`CompiledStep`, compiled or eager.

    Returns None where the step does not serve this token (a cache of fewer than two cells, a sliding layer
    that must move its cells first, a compilation that failed): the caller then uses another path. Inductor
    keeps the compiled graph on disk (:func:`inductor_cache_dir`), so a later process skips most of the
    first call's wait; ``notify`` hears a line when compilation starts and when it fails.
    """

    def __init__(
        self, model: nn.Module, compile: bool = True, notify: Callable[[str], None] = _stderr
    ) -> None:
        self.step = CompiledStep(model)
        self.compile, self.notify = compile, notify
        self.fn: Callable[..., torch.Tensor] | None = self.step.__call__
        self.compiled = False  # whether the compiled function has run once
        if compile:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()
            # every model and weight format a process decodes adds graphs for the one layer function
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            self.step.layer_fn = torch.compile(layer_rows, dynamic=True)
        self.tables: dict[tuple, GroupedRotations] = {}
        self.cells: StepCells | None = None

    def grouped_tables(
        self, n: int, params: list[SelfExtendParams | None] | None = None
    ) -> list[GroupedRotations | None]:
        """Each layer's Self-Extend tables for positions below ``n`` (built once per setting and size), for
        its ``params`` (:meth:`CompiledStep.self_extend`'s, read here where not given)."""
        params = self.step.self_extend() if params is None else params
        out: list[GroupedRotations | None] = []
        for p, inv_freq in zip(params, frequencies(params), strict=True):
            if p is None:
                out.append(None)
                continue
            key = (p.group_size, p.window, inv_freq.data_ptr(), inv_freq._version)
            found = self.tables.get(key)
            if found is None or found.keys.cos.shape[2] < n:
                found = self.tables[key] = GroupedRotations.build(n, p)
            out.append(found)
        return out

    @torch.no_grad()
    def __call__(self, token: int, cache: ContextShiftCache) -> torch.Tensor | None:
        """Logits (vocab,) of the next token after ``token`` written at ``cache.n_past``, or None (see above).
        The cache must have room for it (``cache.make_room(1)`` first)."""
        if self.fn is None or cache.n_past < 2 or not self.step.supported():
            return None
        if self.cells is None or self.cells.cache is not cache:
            self.cells = StepCells(cache)
        cells = self.cells.prepare()
        if cells is None:
            return None
        device = cells.slots.device
        pos = torch.tensor([cache.n_past], device=device)
        grouped = self.grouped_tables(cache.n_ctx)
        if self.compile and not self.compiled:
            self.notify(
                f"compiling the decode step (once; kept in {os.environ['TORCHINDUCTOR_CACHE_DIR']}) ..."
            )
        try:
            with no_duck_shapes():
                logits = self.fn(torch.tensor([[token]], device=device), pos, cells, grouped)
        except Exception as e:  # noqa: BLE001 - any compiler failure: decode eagerly instead
            if not self.compile or self.compiled:
                raise
            self.notify(
                f"warning: compiling the decode step failed, decoding eagerly ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''})"
            )
            self.fn = None
            return None
        self.compiled = True
        self.cells.commit()
        return logits


_STEPS: weakref.WeakKeyDictionary[nn.Module, dict[bool, FastDecode]] = weakref.WeakKeyDictionary()


def fast_decode_for(model: nn.Module, compile: bool = True) -> FastDecode | None:
    """The model's :class:`FastDecode` (one per model and mode, so the graph compiles once per process),
    or None when :class:`CompiledStep` does not serve the model."""
    if why_not(model):
        return None
    steps = _STEPS.setdefault(model, {})
    if compile not in steps:
        steps[compile] = FastDecode(model, compile)
    return steps[compile]
