"""One generated token through a Llama-family model, directly: the decode step of endless generation.

transformers' forward is general: per layer a token passes through a dozen module calls,
mask and position plumbing and an attention dispatch by name. For a single token on a CPU
that glue costs about as much as the attention itself. :class:`DecodeStep` reads the same
weights and writes the same :class:`~selfextend.kv.cache.ContextShiftCache`, and computes the same
math as the model's forward (tests hold it to the model's own logits) with fewer operations:
the query/key/value and gate/up projections of int8 and int4 models run as one fused product each, the
quantized kernels and norms are called directly (:mod:`selfextend.generation.products`), and attention,
plain or Self-Extend, is the native kernel of :mod:`selfextend.generation.native` where it
builds (else SDPA, or Self-Extend's decode path).

It serves models whose layers are plain Llama blocks (Llama, Mistral and Qwen2 without
sliding windows); :func:`decode_step_for` returns None for anything else, and callers then
use the model's forward. Forward hooks on the submodules are not run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from selfextend.core.cells import cells_of
from selfextend.core.decode_query import grouped_decode_keys, self_extend_decode
from selfextend.core.positions import grouped_query_positions
from selfextend.core.rope import Rotation
from selfextend.generation.native import native_kernels
from selfextend.generation.products import LayerPlan, direct, norm_of, product_of
from selfextend.hf.patch import IMPLEMENTATION, SelfExtendParams
from selfextend.kv.cache import ContextShiftCache
from selfextend.kv.layers import CellLayer, ContextShiftLayer
from selfextend.models.quantize import Int4Linear, Int8Linear, fuse_int4, fuse_int8

FAMILIES = ("llama", "mistral", "qwen2")
ATTENTION = ("sdpa", IMPLEMENTATION)


def fuse_projections(projections: list[nn.Module]) -> tuple[nn.Module, ...]:
    """One fused projection when all are int8, or all int4 in blocks that concatenate (no second copy of
    the weights), else all of them.

    Fused once per set of layers (remembered on the first one): a second decode step over the same model
    gets the same fused layer, where fusing the views again would copy the weights.
    """
    kinds = {type(p) for p in projections}
    fuse = {Int8Linear: fuse_int8, Int4Linear: fuse_int4}.get(kinds.pop()) if len(kinds) == 1 else None
    if fuse is None:
        return tuple(projections)
    ids = tuple(id(p) for p in projections)
    found = getattr(projections[0], "_fused_with", None)
    if found is None or found[0] != ids:
        found = (ids, fuse(projections))
        projections[0]._fused_with = found  # a tuple: not registered as a submodule
    return tuple(projections) if found[1] is None else (found[1],)


def _why_not(model: nn.Module) -> str | None:
    """Why :class:`DecodeStep` cannot run ``model``, or None when it can."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type}"
    if getattr(config, "sliding_window", None) or any(
        t != "full_attention" for t in getattr(config, "layer_types", None) or []
    ):
        return "sliding-window attention"
    if config.hidden_act != "silu" or getattr(config, "pretraining_tp", 1) > 1:
        return "activation or tensor-parallel layout"
    return layout_problem(model)


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
    """Whether :class:`DecodeStep` runs ``model`` (plain Llama blocks), without building one."""
    return _why_not(model) is None


def decode_step_for(model: nn.Module) -> DecodeStep | None:
    """A :class:`DecodeStep` for ``model``, or None when its architecture is not a plain Llama block."""
    return DecodeStep(model) if serves(model) else None


def _query_rotation(
    known: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], pos: int, p: SelfExtendParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (rot_dim,) of the rotation that takes a query at ``pos`` to its grouped position under
    ``p``, computed once per token for the layers sharing ``p``'s settings (``known``)."""
    delta = grouped_query_positions(pos, p.group_size, p.window) - pos
    key = (delta, id(p.inv_freq))
    if key not in known:
        r = Rotation.of(torch.tensor([delta]), p.inv_freq)
        known[key] = r.cos.reshape(-1).contiguous(), r.sin.reshape(-1).contiguous()
    return known[key]


class DecodeStep:
    """``step(token, cache) -> logits``: one token at the next position of a context-shift cache.

    The cache must have room for it (``cache.make_room(1)`` first). Works with the model's
    attention implementation at call time: ``sdpa`` or ``selfextend``; :meth:`supported` says
    whether the current one is served.
    """

    def __init__(self, model: nn.Module, native: bool = True) -> None:
        """``native``: use the native kernels where they build (False: torch ops only, SDPA attention)."""
        reason = _why_not(model)
        if reason:
            raise ValueError(f"DecodeStep does not support this model ({reason})")
        self.model = model
        inner = model.model
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.layers = list(inner.layers)
        self.head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = d = attn.head_dim
        self.heads = [p.out_features // d for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        self.native = native_kernels() if native else None
        self.qkv, self.gate_up, self.plan = [], [], []
        dtype = self.embed.weight.dtype
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.qkv.append(fuse_projections([a.q_proj, a.k_proj, a.v_proj]))
            self.gate_up.append(fuse_projections([mlp.gate_proj, mlp.up_proj]))
            self.plan.append(LayerPlan.of(layer, self.qkv[-1], self.gate_up[-1], dtype, self.native))
        head = (self.head,)
        self.final_norm = norm_of(self.norm, dtype, self.native if direct(head) else None)
        self.head_product = product_of(head, self.native)

    def supported(self) -> bool:
        """Whether the model's current attention implementation is one this step computes."""
        return self.model.config._attn_implementation in ATTENTION

    @torch.no_grad()
    def __call__(self, token: int, cache: ContextShiftCache) -> torch.Tensor:
        """Logits (vocab,) of the next token after ``token``, written at position ``cache.n_past``."""
        pos = cache.n_past
        self_extend = self.model.config._attn_implementation == IMPLEMENTATION
        x = self.embed.weight[token].view(1, -1).clone()  # (1, hidden), added to in place
        position_ids = torch.tensor([[pos]], device=x.device)
        rot = Rotation.from_cos_sin(*(t[:, None] for t in self.rotary(x[None], position_ids)))  # (1, 1, 1, D)
        first = cache.layers[0]  # every layer's cells have its layout: checked once for all
        kernel = self.native
        if kernel is not None and not (
            isinstance(first, ContextShiftLayer) and kernel.takes(self.heads[0], first.keys, first.values)
        ):
            kernel = None
        if kernel is not None:
            rotation = rot.cos.reshape(-1).contiguous(), rot.sin.reshape(-1).contiguous()  # (rot_dim,) each
            grouped_rotations: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for i, (layer, plan) in enumerate(zip(self.layers, self.plan, strict=True)):
            attn = layer.self_attn
            qkv = plan.qkv(plan.norm(x))  # (1, (H + 2 Hkv) * D)
            if kernel is not None:
                cells = cache.layers[i]
                slot = cells.claim()
                p = attn.self_extend if self_extend and attn.self_extend.group_size > 1 else None
                by = None if p is None else _query_rotation(grouped_rotations, pos, p)
                q, q_g = kernel.rope_write(
                    qkv.float(), self.heads[:2], rotation, cells.keys, cells.values, slot, by, checked=True
                )
                k, v = cells.keys[..., : slot + 1, :], cells.values[..., : slot + 1, :]  # (1, Hkv, cells, D)
                k_g = None
                if p is not None:
                    k_g = grouped_decode_keys(
                        k,
                        pos,
                        p.group_size,
                        p.window,
                        p.inv_freq,
                        cells.cells(slot + 1),
                        p.rotations,
                        torch.float32,
                    )
                out = kernel(q, k, v, attn.scaling, None if k_g is None else (q_g, k_g), checked=True)
            else:
                out = self._attend(attn, qkv.to(x.dtype), rot, cache.layers[i], pos, self_extend)
            x += plan.o_proj(out.to(x.dtype).view(1, -1))  # (1, H, 1, D) -> (1, H * D)
            x += plan.down_proj(plan.act(plan.gate_up(plan.post_norm(x))))
        return self.head_product(self.final_norm(x))[0].to(x.dtype)

    def _attend(
        self, attn: nn.Module, qkv: torch.Tensor, rot: Rotation, cells: CellLayer, pos: int, self_extend: bool
    ) -> torch.Tensor:
        """Attention through torch where the native kernel is not built: (1, H, 1, D). Without Self-Extend,
        SDPA reads a bf16/f16 cache's cells as stored (half the bytes); Self-Extend reads them upcast."""
        d, n_qk = self.head_dim, self.heads[0] + self.heads[1]
        qkv = qkv.view(1, -1, 1, d)  # (1, H + 2 Hkv, 1, D)
        q, k = rot.apply(qkv[:, :n_qk]).split(self.heads[:2], dim=1)  # one rotation for both
        cells_type = cells.keys.dtype if not self_extend else qkv.dtype
        k, v = cells.update(k.to(cells_type), qkv[:, n_qk:].to(cells_type))  # (1, Hkv, cells, D)
        if self_extend:
            p = attn.self_extend
            return self_extend_decode(
                q, k, v, pos, p.group_size, p.window, p.inv_freq, attn.scaling, cells_of(k), p.rotations
            )
        return F.scaled_dot_product_attention(q.to(k.dtype), k, v, scale=attn.scaling, enable_gqa=True)
