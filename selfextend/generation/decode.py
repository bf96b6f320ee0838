"""One generated token through a Llama-family or Gemma 3 model, directly: endless generation's decode step.

transformers' forward is general: per layer a token passes through a dozen module calls,
mask and position plumbing and an attention dispatch by name. For a single token on a CPU
that glue costs about as much as the attention itself. :class:`DecodeStep` reads the same
weights and writes the same :class:`~selfextend.kv.cache.ContextShiftCache`, and computes the same
math as the model's forward (tests hold it to the model's own logits) with fewer operations:
the query/key/value and gate/up projections of int8 and int4 models run as one fused product each, the
quantized kernels and norms are called directly (:mod:`selfextend.generation.products`), and attention,
plain or Self-Extend, is the native kernel of :mod:`selfextend.native.decode` where it
builds (else SDPA, or Self-Extend's decode path). Where every projection is a GGUF block layer, all the
layers of a token run in one native call (:mod:`selfextend.generation.native_layers`: the same kernels in
the same order, the same logits).

It serves Llama, Mistral, Qwen2 and Qwen3 blocks and Gemma 3's (norms after attention and MLP, GeGLU,
q/k norms, a RoPE base per kind of layer, sliding-window layers, a scaled embedding); a sliding layer's
query reads the last run of its cells in position order (:meth:`~selfextend.kv.layers.CellLayer.claim`
compacts a wrapped ring first). :func:`decode_step_for` returns None for anything else, and callers then
use another path. Forward hooks on the submodules are not run.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from selfextend.core.cells import cells_of
from selfextend.core.decode_query import grouped_decode_keys, self_extend_decode
from selfextend.core.rope import Rotation
from selfextend.generation.native_layers import native_layers
from selfextend.generation.products import LayerPlan, direct, each, each_add, fuse_float, norm_of, product_of
from selfextend.generation.rotary import PositionRotations, rope_by_kind, rotations_at
from selfextend.generation.step_rows import RowBatch, query_rotation, row_positions, rows_of_a_cache
from selfextend.hf.facts import layer_kinds, sliding_windows
from selfextend.hf.patch import IMPLEMENTATION, SelfExtendParams
from selfextend.kv.cache import ContextShiftCache
from selfextend.kv.layers import CellLayer
from selfextend.models.blocks import BlockEmbedding, BlockLinear, fuse_blocks
from selfextend.models.quantize import Int4Linear, Int8Linear, fuse_int4, fuse_int8
from selfextend.native.decode import GATED, NativeKernels, native_kernels, rotation_fits
from selfextend.native.quant import quant_kernels

log = logging.getLogger(__name__)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
ATTENTION = ("sdpa", "eager", IMPLEMENTATION)  # one math (attention soft-capping is refused by why_not)


# (the projections' ids, where their tensors were once fused, the fused layer) by the first projection
_FUSED: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def tensors_key(modules: Sequence[nn.Module]) -> tuple:
    """Where the modules' own parameters and buffers live (address, type, device): a tensor replaced by
    another (``module.weight = ...``, ``model.to(...)``) changes it, an edit in place does not."""
    return tuple(
        (t.data_ptr(), t.dtype, t.device)
        for m in modules
        for owned in (m._parameters, m._buffers)  # the modules' own, without named_parameters' walk
        for t in owned.values()
        if t is not None
    )


def fuse_projections(projections: list[nn.Module]) -> tuple[nn.Module, ...]:
    """One fused projection when all are int8, or all int4 in blocks that concatenate (no second copy of
    the weights); GGUF block layers fused by runs of one type; float layers on a GPU (:func:`fuse_float`:
    the model's weights re-pointed at views of the fused one); else all of them.

    Fused once per set of layers (remembered for the first one, outside the model: a deep copy of it fuses
    its own): a second decode step over the same model gets the same fused layer, where fusing the views
    again would copy the weights. Fused again where a projection's weight was replaced since (a fused
    float layer holds the old values: a step made after the edit would read them).
    """
    kinds = {type(p) for p in projections}
    fusers = {Int8Linear: fuse_int8, Int4Linear: fuse_int4, BlockLinear: fuse_blocks, nn.Linear: fuse_float}
    fuse = fusers.get(kinds.pop()) if len(kinds) == 1 else None
    if fuse is None:
        return tuple(projections)
    ids = tuple(id(p) for p in projections)
    found = _FUSED.get(projections[0])
    if found is None or found[:2] != (ids, tensors_key(projections)):
        fused = fuse(projections)  # re-points a float layer's weights: the key is taken after
        found = _FUSED[projections[0]] = (ids, tensors_key(projections), fused)
    fused = found[2]
    return tuple(projections) if fused is None else fused if isinstance(fused, tuple) else (fused,)


def why_not(model: nn.Module) -> str | None:
    """Why :class:`DecodeStep` (and the compiled step, which serves the same families) cannot run ``model``,
    or None when it can."""
    return config_problem(model.config) or layout_problem(model)


def config_problem(config) -> str | None:
    """Why :class:`DecodeStep` cannot run a model of ``config`` whatever its layout, or None."""
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type}"
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in GATED or getattr(config, "pretraining_tp", 1) > 1:
        return "activation or tensor-parallel layout"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    return None


def layout_problem(model: nn.Module) -> str | None:
    """Why a step that reads the model's modules directly cannot run it (accelerate's device map, or not
    the ``model.model.{embed_tokens, layers, norm, rotary_emb}`` layout), or None."""
    if len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1:
        return "layers placed by a device map (accelerate's hooks run only through the modules' forwards)"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "module layout"
    return None


def serves(model: nn.Module) -> bool:
    """Whether :class:`DecodeStep` runs ``model``, without building one."""
    return why_not(model) is None


_NOTED: set[str] = set()  # the reasons already said in this process


def decode_step_for(model: nn.Module) -> DecodeStep | None:
    """A :class:`DecodeStep` for ``model``, or None when it does not serve its architecture (said once per
    reason, in one line: each token then runs through the model's forward, the slower path)."""
    reason = why_not(model)
    if reason is None:
        return DecodeStep(model)
    if reason not in _NOTED:
        _NOTED.add(reason)
        log.info("direct decode step not used (%s): tokens run through the model's forward, slower", reason)
    return None


class DecodeStep:
    """``step(token, cache) -> logits``: one token at the next position of a context-shift cache.

    The cache must have room for it (``cache.make_room(1)`` first). Works with the model's
    attention implementation at call time: ``sdpa`` or ``selfextend``; :meth:`supported` says
    whether the current one is served. :attr:`head_product` is the output layer's product, x (M, hidden)
    -> (M, vocab): a draft model's may score part of the vocabulary
    (:mod:`~selfextend.generation.draft_vocab`).
    """

    def __init__(self, model: nn.Module, native: bool = True) -> None:
        """``native``: use the native kernels where they build (False: torch ops only, SDPA attention)."""
        reason = why_not(model)
        if reason:
            raise ValueError(f"DecodeStep does not support this model ({reason})")
        self.model = model
        self.device = next(model.parameters()).device
        inner = model.model
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.embed_scale = getattr(self.embed, "embed_scale", None)  # Gemma's sqrt(hidden)
        table = isinstance(self.embed, BlockEmbedding)  # a GGUF table held as blocks: rows looked up
        self.dtype = self.embed.dtype if table else self.embed.weight.dtype  # the hidden states' type
        self.layers = list(inner.layers)
        self.head = model.lm_head
        config = model.config
        self.kinds, self.windows = layer_kinds(model), sliding_windows(config)
        self.by_kind = rope_by_kind(self.rotary)
        self.rope = PositionRotations(self.rotary, self.kinds)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        attn = self.layers[0].self_attn
        self.head_dim = d = attn.head_dim
        self.heads = [p.out_features // d for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        # the native kernels read CPU memory: on any other device the step is torch's ops alone
        self.native = native_kernels() if native and self.device.type == "cpu" else None
        self.qkv, self.gate_up, self.plan = [], [], []
        dtype = self.dtype
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.qkv.append(fuse_projections([a.q_proj, a.k_proj, a.v_proj]))
            self.gate_up.append(fuse_projections([mlp.gate_proj, mlp.up_proj]))
            self.plan.append(LayerPlan.of(layer, self.qkv[-1], self.gate_up[-1], dtype, self.native))
        normed = all(
            plan.head_norms is not None or not hasattr(m.self_attn, "q_norm")
            for m, plan in zip(self.layers, self.plan, strict=True)
        )
        # attention: q/k norms it cannot apply, or a rotation wider than a head, stay in torch
        self.kernel = self.native if normed and self._rotations_fit() else None
        self.native_layers = None  # every layer in one native call, where all of them are what it computes
        if self.kernel is not None and dtype == torch.float32:
            self.native_layers = native_layers(
                self.layers,
                self.qkv,
                self.gate_up,
                self.heads,
                self.kinds,
                self.windows,
                self.kernel,
                quant_kernels(),
            )
        head = (self.head,)
        self.final_norm = norm_of(self.norm, dtype, self.native if direct(head) else None)
        self.head_product = product_of(head, self.native, logits=True)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows ``ids`` (M,) -> (M, hidden), unscaled: a copy, which callers add to."""
        if isinstance(self.embed, BlockEmbedding):
            return self.embed.lookup(ids)
        return self.embed.weight[ids]

    def _rotations_fit(self) -> bool:
        """Whether each kind's rotation is what the native ``rope_write`` reads (checked once: the rotary
        module gives the same size and type at every position)."""
        at = torch.zeros(1, dtype=torch.long, device=self.device)
        x = self.embed_rows(at).view(1, 1, -1)
        found = rotations_at(self.rotary, self.kinds, self.by_kind, x, at)
        flat = [(r.cos.reshape(-1).contiguous(), r.sin.reshape(-1).contiguous()) for r in found.values()]
        return all(rotation_fits(pair, self.head_dim) for pair in flat)

    def supported(self) -> bool:
        """Whether the model's current attention implementation is one this step computes."""
        return self.model.config._attn_implementation in ATTENTION

    def _kernel(self, cache: ContextShiftCache) -> NativeKernels | None:
        """The native kernels where they read this cache's cells (every layer's have the first's layout), else
        None."""
        kernel, first = self.kernel, cache.layers[0]
        if kernel is None or not (
            isinstance(first, CellLayer) and kernel.takes(self.heads[0], first.keys, first.values)
        ):
            return None
        return kernel

    @torch.no_grad()
    def __call__(self, token: int, cache: ContextShiftCache) -> torch.Tensor:
        """Logits (vocab,) of the next token after ``token``, written at position ``cache.n_past``."""
        return self.rows([token], [cache])[0]

    @torch.no_grad()
    def rows(self, tokens: Sequence[int], caches: Sequence[ContextShiftCache]) -> torch.Tensor:
        """Logits (M, vocab): row ``j`` the next token's after ``tokens[j]``, written at ``caches[j].n_past``
        (each cache with room for it); rows that share a cache are its next tokens in order, each attending
        the ones before it (several drafted tokens checked in one pass).

        The sequences share each product (M rows: the weights are read once for all); norms, rotation and
        attention run per row over that sequence's own cells (its positions, Self-Extend grouping and sliding
        layers). Every per-row operation is the one a lone token takes, so where the products are batch-
        invariant (the native GGUF block products) a row's logits are bit for bit those of stepping it alone.
        """
        pos = row_positions(caches)
        if len(caches) > 1:  # a cache's several rows: its sliding layers make room for all of them at once
            for cache in {id(c): c for c in caches}.values():
                cache.reserve(sum(c is cache for c in caches))
        ids = torch.tensor(tokens, device=self.device)
        x = self.embed_rows(ids)  # (M, hidden): a copy, added to in place
        x = x * self.embed_scale.to(x.dtype) if self.embed_scale is not None else x
        flat = self.rope(x[:, None], pos)  # each row's rotation by kind, as decode.c reads it
        batch = RowBatch(caches, pos, [self._kernel(c) for c in caches], flat, {})
        self_extend = self.model.config._attn_implementation == IMPLEMENTATION
        extend = [self._self_extend(layer) if self_extend else None for layer in self.layers]
        if (
            self.native_layers is not None
            and None not in batch.kernels
            and len({c.layers[0].keys.dtype for c in caches}) == 1
            and rows_of_a_cache(caches) <= min((p.window for p in extend if p is not None), default=len(pos))
        ):  # a cache's row past W of its rows would group cells the call writes: the loop, row by row
            grouped = partial(self._grouped_keys, batch, extend) if extend.count(None) < len(extend) else None
            self.native_layers(x, caches, pos, flat, grouped)
        else:
            for i, (p, plan) in enumerate(zip(extend, self.plan, strict=True)):
                qkv = plan.qkv(each(plan.norm, x))  # (M, (H + 2 Hkv) * D)
                out = torch.cat([self._attend_row(batch, j, i, qkv[j : j + 1], p) for j in range(len(pos))])
                each_add(plan.add_attention, x, plan.o_proj(out.to(x.dtype)))  # out: (M, H * D)
                each_add(
                    plan.add_mlp, x, plan.down_proj(each(plan.act, plan.gate_up(each(plan.post_norm, x))))
                )
        logits = self.head_product(each(self.final_norm, x)).to(x.dtype)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _grouped_keys(
        self, batch: RowBatch, extend: list[SelfExtendParams | None], i: int, j: int, cells: CellLayer
    ) -> tuple[torch.Tensor, int, tuple[torch.Tensor, torch.Tensor]] | None:
        """Row ``j``'s grouped keys at layer ``i`` (Self-Extend settings ``extend[i]``, a full layer's
        ``cells`` before the token's cell is claimed) as :meth:`_attend_row` hands them to the attention
        kernel: ``(keys, n_g, rotation)``, the first ``n_g`` rows per KV head of ``keys`` (1, Hkv, >= n_g, D)
        in the cells' type with contiguous rows, and the query's grouped rotation; None where it scores none.
        The token's own cell is at distance 0 < W: never a grouped one. Usually the cells' own buffer, known
        at once (:meth:`~selfextend.kv.layers.CellLayer.grouped_now`: no torch call on a token's path)."""
        p = extend[i]
        if p is None:
            return None
        pos, end = batch.pos[j], cells.n_used
        by = query_rotation(batch.grouped, pos, p, self.head_dim)
        held = cells.grouped_now(pos, p.group_size, p.window, p.inv_freq) if self.windows[i] is None else None
        if held is not None:
            return None if held[0] is None else (*held, by)
        first = cells.visible_from(pos, self.windows[i])
        k = cells.keys[..., first:end, :]  # (1, Hkv, cells, D)
        # the cells the rows before j of this cache claimed are written in the call, after this: not ready
        start = min(q for q, c in zip(batch.pos, batch.caches, strict=True) if c is batch.caches[j])
        ready = end - (pos - start)
        k_g = grouped_decode_keys(
            k, pos, p.group_size, p.window, p.inv_freq, cells.cells(end, ready), p.rotations
        )
        if k_g is None:
            return None
        k_g = k_g.to(k.dtype)
        if k_g.stride(-1) != 1 or k_g.stride(-2) != self.head_dim:
            k_g = k_g.contiguous()
        return k_g, k_g.shape[2], by

    def most_rows(self) -> int:
        """The most rows one cache takes in one native call: Self-Extend's smallest neighbour window W (a
        row W past the first would group a cell the call writes; :meth:`rows` runs more row by row)."""
        self_extend = self.model.config._attn_implementation == IMPLEMENTATION
        windows = [p.window for p in map(self._self_extend, self.layers) if p is not None and self_extend]
        return min(windows, default=1 << 30)

    @staticmethod
    def _self_extend(layer: nn.Module) -> SelfExtendParams | None:
        """The layer's Self-Extend settings where they group positions (group size above 1), else None."""
        p = getattr(layer.self_attn, "self_extend", None)
        return p if isinstance(p, SelfExtendParams) and p.group_size > 1 else None

    def _attend_row(
        self, batch: RowBatch, j: int, i: int, qkv: torch.Tensor, p: SelfExtendParams | None
    ) -> torch.Tensor:
        """Row ``j``'s query, key and value ``qkv`` (1, (H + 2 Hkv) * D) at layer ``i``: the key and value
        written into its cells, the attention over them (1, H * D)."""
        attn, cells, window, pos = (
            self.layers[i].self_attn,
            batch.caches[j].layers[i],
            self.windows[i],
            batch.pos[j],
        )
        cos_sin = batch.flat[j][self.kinds[i]]
        kernel = batch.kernels[j]
        if kernel is None:
            rot = Rotation(*(t.view(1, 1, 1, -1) for t in cos_sin))
            return self._attend(attn, qkv.to(self.dtype), rot, cells, pos, p, window).reshape(1, -1)
        slot = cells.claim()
        first = cells.visible_from(pos, window)
        by = None if p is None else query_rotation(batch.grouped, pos, p, self.head_dim)
        q, q_g = kernel.rope_write(
            qkv.float(),
            self.heads[:2],
            cos_sin,
            cells.keys,
            cells.values,
            slot,
            by,
            checked=True,
            norms=self.plan[i].head_norms,
        )
        end = slot + 1
        k, v = cells.keys[..., first:end, :], cells.values[..., first:end, :]  # (1, Hkv, cells, D)
        k_g = None
        if p is not None:
            k_g = grouped_decode_keys(
                k, pos, p.group_size, p.window, p.inv_freq, cells.cells(end), p.rotations
            )
        out = kernel(q, k, v, attn.scaling, None if k_g is None else (q_g, k_g), checked=True)
        return out.reshape(1, -1)  # (1, H, 1, D) -> (1, H * D)

    def _attend(
        self,
        attn: nn.Module,
        qkv: torch.Tensor,
        rot: Rotation,
        cells: CellLayer,
        pos: int,
        p: SelfExtendParams | None,
        window: int | None,
    ) -> torch.Tensor:
        """Attention through torch where the native kernel is not built: (1, H, 1, D). Without Self-Extend,
        SDPA reads a bf16/f16 cache's cells as stored (half the bytes); Self-Extend reads them upcast."""
        d, n_qk = self.head_dim, self.heads[0] + self.heads[1]
        qkv = qkv.view(1, -1, 1, d)  # (1, H + 2 Hkv, 1, D)
        q, k = qkv[:, :n_qk].split(self.heads[:2], dim=1)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rot.apply(q), rot.apply(k)
        cells_type = cells.keys.dtype if p is None else qkv.dtype
        k, v = cells.update(k.to(cells_type), qkv[:, n_qk:].to(cells_type))  # (1, Hkv, cells, D)
        if p is not None:
            return self_extend_decode(
                q, k, v, pos, p.group_size, p.window, p.inv_freq, attn.scaling, cells_of(k), p.rotations
            )
        if window is not None and not cells.is_sliding:  # all cells kept (a full-size layer): the last ones
            first = cells.visible_from(pos, window)
            k, v = k[..., first:, :], v[..., first:, :]
        return F.scaled_dot_product_attention(q.to(k.dtype), k, v, scale=attn.scaling, enable_gqa=True)
