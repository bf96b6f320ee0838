"""A decode step that ``torch.compile`` takes: one graph for every layer, fill, shift and Self-Extend group.

The step reads the model's modules and writes each layer's new key and value into the cache's cells;
attention is plain tensor ops the compiler fuses. Shapes that change from token to token (the cells in
use) are dynamic, positions are tensors, and which cells a query sees comes from their positions:

- a cell at position ``j`` is visible to the query at ``p`` iff ``j <= p`` (and ``p - j < window`` on a
  sliding layer, whose cells may be in any order);
- with Self-Extend, the score of a key with ``p - j >= W`` uses the grouped positions of
  :mod:`selfextend.core.positions`: the cached key (rotated at ``j``) is rotated by ``j // G - j`` and
  the query by its grouped offset, from tables of float32 factors computed once in float64.

So a context shift (done by the cache, outside the step) and Self-Extend's grouping never change the
graph. Families: Llama, Mistral, Qwen2, Qwen3 and Gemma 3. What is compiled is one decoder layer
(:func:`layer_rows`), called for every layer with its weights: all layers share its graph (one per kind of
attention: sliding, full, grouped), so the first compile traces one layer, not the model. Run eagerly for
one row, an int8 output head is the native one (native/decode.py).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config

from selfextend.core.fused_decode import fused_decode_applies, fused_decode_attention
from selfextend.core.positions import grouped_key_positions, grouped_query_positions, is_neighbor
from selfextend.core.rope import Rotation
from selfextend.generation.cells import Cells, StepCells
from selfextend.generation.decode import ATTENTION, fuse_projections, why_not
from selfextend.generation.products import direct, product_of, project
from selfextend.generation.rotary import rope_by_kind, rotations_at
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


@dataclass(frozen=True)
class GroupedRotations:
    """Self-Extend's extra rotations by position, float32 factors (1, 1, n, rot_dim) computed in float64:
    ``keys[j]`` turns a key cached at ``j`` into one at ``j // G``, ``queries[p]`` the query at ``p`` into
    one at its grouped position."""

    keys: Rotation
    queries: Rotation
    window: int

    @classmethod
    def build(cls, n: int, params: SelfExtendParams) -> GroupedRotations:
        """The tables for positions ``[0, n)`` under ``params`` (group size, window, frequencies)."""
        g, w, inv_freq = params.group_size, params.window, params.inv_freq
        at = torch.arange(n, device=inv_freq.device)
        keys = Rotation.of(grouped_key_positions(at, g) - at, inv_freq)
        queries = Rotation.of(grouped_query_positions(at, g, w) - at, inv_freq)
        return cls(keys, queries, w)

    def query_at(self, pos: torch.Tensor) -> Rotation:
        """The rotation (1, 1, 1, rot_dim) turning the query at ``pos`` (1,) into one at its grouped
        position (indexed on the device: nothing read on the host)."""
        return Rotation(self.queries.cos[:, :, pos], self.queries.sin[:, :, pos])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int | None,
    grouped: GroupedRotations | None,
    fused: bool = True,
    stored: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query row over a layer's cells: q (1, H, 1, D) at ``pos`` (1,), k and v (1, Hkv, n, D) at
    ``positions`` (n,) -> (1, 1, H * D) in float32. One softmax over neighbor and grouped scores, the grouped
    keys rotated here or ``stored`` (1, Hkv, n, D) as the cache keeps them (:mod:`selfextend.kv.grouped`).
    On CUDA (or under Triton's interpreter) with triton installed, the fused kernels of
    :mod:`~selfextend.core.fused_decode` compute the same, reading each cell once (``fused`` False: the
    tensor ops anyway, what the kernels are checked and timed against)."""
    if fused and fused_decode_applies(q, k, v):
        if grouped is None:
            return fused_decode_attention(q, k, v, positions, pos, scale, window)
        q_g = grouped.query_at(pos).apply(q.float())  # (1, H, 1, D) float32
        keys, w = grouped.keys, grouped.window
        return fused_decode_attention(q, k, v, positions, pos, scale, window, q_g, keys, w, stored=stored)
    b, hkv, _, d = k.shape
    qf = q.float().reshape(b, hkv, -1, d)  # (B, Hkv, H / Hkv, D): the heads sharing a KV head as rows
    kf = k.float()
    fused = torch.compiler.is_compiling()
    scores = _row_scores(qf, kf, fused)  # (B, Hkv, H / Hkv, n)
    distance = pos - positions  # (n,)
    visible = distance >= 0
    if window is not None:
        visible = visible & (distance < window)
    if grouped is not None:
        rk = grouped.keys
        at = positions.clamp(max=rk.cos.shape[2] - 1)  # a cell not in use (past every query) is masked below
        k_g = Rotation(rk.cos[:, :, at], rk.sin[:, :, at]).apply(kf) if stored is None else stored.float()
        q_g = grouped.query_at(pos).apply(qf)
        scores = torch.where(is_neighbor(distance, grouped.window), scores, _row_scores(q_g, k_g, fused))
    scores = (scores * scale).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if fused:
        out = (probs.unsqueeze(-1) * v.float().unsqueeze(-3)).sum(-2)  # (B, Hkv, H / Hkv, D)
    else:
        out = probs @ v.float()  # (B, Hkv, H / Hkv, D)
    return out.reshape(b, 1, -1)


def _row_scores(q: torch.Tensor, k: torch.Tensor, fused: bool) -> torch.Tensor:
    """q (B, Hkv, R, D) against k (B, Hkv, n, D) -> (B, Hkv, R, n); ``fused`` (compiling): a reduction the
    compiler fuses into one pass over the keys, not a matrix product of a few rows."""
    if fused:
        return (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1)  # (B, Hkv, R, n, D) summed over D
    return q @ k.transpose(-1, -2)


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
        self.layer_fn: Callable[..., torch.Tensor] = layer_rows
        self.head_row = product_of((self.head,), native_kernels()) if direct((self.head,)) else None

    def supported(self) -> bool:
        """Whether the model's current attention implementation is one this step computes."""
        return self.config._attn_implementation in ATTENTION

    def self_extend(self) -> list[SelfExtendParams | None]:
        """Each layer's Self-Extend parameters under the ``selfextend`` attention, else None."""
        if self.config._attn_implementation != IMPLEMENTATION:
            return [None] * len(self.layers)
        found = [getattr(m.self_attn, "self_extend", None) for m in self.layers]
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
        for i, layer in enumerate(self.layers):
            layer_cells = [
                LayerCells(
                    c.keys[i], c.values[i], c.positions[i], c.slots[i : i + 1], c.grouped and c.grouped[i]
                )
                for c in cells
            ]
            x = self.layer_fn(
                layer,
                self.qkv[i],
                self.gate_up[i],
                x,
                rotations[self.kinds[i]],
                pos,
                layer_cells,
                self.windows[i],
                grouped[i],
            )
        if self.head_row is not None and x.shape[0] == 1:  # (the head is never inside a compiled graph)
            logits = self.head_row(self.norm(x).view(1, -1)).to(x.dtype)  # (1, hidden) -> (1, vocab)
        else:
            logits = self.head(self.norm(x))[:, -1]  # (B, vocab)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class LayerCells(NamedTuple):
    """One row's cells in one layer: keys and values (1, Hkv, capacity, D), positions (n,) of the first
    ``n`` slots, the new token's slot (1,), and the keys at grouped positions the cache keeps, or None."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    slot: torch.Tensor
    grouped: torch.Tensor | None = None


def layer_rows(
    layer: nn.Module,
    qkv_parts: tuple[nn.Module, ...],
    gate_up_parts: tuple[nn.Module, ...],
    x: torch.Tensor,
    rot: Rotation,
    pos: torch.Tensor,
    cells: list[LayerCells],
    window: int | None,
    grouped: GroupedRotations | None,
) -> torch.Tensor:
    """One decoder layer for B rows: the residual stream ``x`` (B, 1, hidden) after the layer, each row's
    key and value written into its ``cells``. The unit that is compiled: every layer of a model has the
    same code and the same shapes, so one graph serves them all (the layer's weights are its inputs), and
    compiling it costs one layer's trace, not the whole model's."""
    attn = layer.self_attn
    b_rows, d = x.shape[0], attn.head_dim
    h = layer.input_layernorm(x)
    qkv = project(qkv_parts, h).view(b_rows, 1, -1, d)  # (B, 1, H + 2 Hkv, D)
    n_kv = cells[0].keys.shape[1]
    q, k, v = qkv.split([qkv.shape[2] - 2 * n_kv, n_kv, n_kv], dim=2)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rot.apply(q.transpose(1, 2)), rot.apply(k.transpose(1, 2))  # (B, H, 1, D)
    v = v.transpose(1, 2)  # (B, Hkv, 1, D)
    outs = []
    for b, c in enumerate(cells):
        n, at, stored = c.positions.shape[0], pos[b : b + 1], None
        key = k[b : b + 1].to(c.keys.dtype)
        c.keys.index_copy_(2, c.slot, key)
        c.values.index_copy_(2, c.slot, v[b : b + 1].to(c.values.dtype))
        if c.grouped is not None:  # the new key at its grouped position too, rounded as the cache keeps it
            rk = grouped.keys
            c.grouped.index_copy_(2, c.slot, Rotation(rk.cos[:, :, at], rk.sin[:, :, at]).apply(key))
            stored = c.grouped[:, :, :n]
        kb, vb = c.keys[:, :, :n], c.values[:, :, :n]  # (1, Hkv, n, D): the cells in use, the new one too
        outs.append(
            attend(q[b : b + 1], kb, vb, c.positions, at, attn.scaling, window, grouped, stored=stored)
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (B, 1, H * D)
    out = attn.o_proj(out.to(x.dtype))
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma: norms after attention and MLP too
        x = x + layer.post_attention_layernorm(out)
        h = layer.pre_feedforward_layernorm(x)
    else:
        x = x + out
        h = layer.post_attention_layernorm(x)
    gate, up = project(gate_up_parts, h).chunk(2, dim=-1)
    out = layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
    if hasattr(layer, "post_feedforward_layernorm"):
        out = layer.post_feedforward_layernorm(out)
    return x + out


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

    def grouped_tables(self, n: int) -> list[GroupedRotations | None]:
        """Each layer's Self-Extend tables for positions below ``n`` (built once per setting and size)."""
        out: list[GroupedRotations | None] = []
        for params in self.step.self_extend():
            if params is None:
                out.append(None)
                continue
            inv_freq = params.inv_freq
            key = (params.group_size, params.window, inv_freq.data_ptr(), inv_freq._version)
            found = self.tables.get(key)
            if found is None or found.keys.cos.shape[2] < n:
                found = self.tables[key] = GroupedRotations.build(n, params)
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
