"""Every decoder layer of a token in one native call: ``decode.c``'s ``decode_layers``.

The decode step's Python loop calls a dozen kernels per layer (norm, products, rotation and cell write,
attention, residual adds, activation), each through a wrapper that checks its arguments and allocates its
output: on SmolLM2 (30 layers) that glue was about 40% of a token on two cores, and the OpenMP workers spun
idle through it. Where every projection of every layer is a GGUF block layer (:mod:`selfextend.native.quant`)
and every norm a known RMSNorm, the same kernels run from one C loop in the same order, so the logits are
those of the Python loop bit for bit (tests hold it so). The rows' cells are claimed in Python first (the
cache's bookkeeping) and handed over as a table of addresses, slots and rotations per layer and row;
with Self-Extend, each layer's grouped keys are the buffer its cells keep rotated (up to 64 keys ahead of
the query, so a token usually finds them with no torch call), handed over with the count to read and
scored in the call.
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Callable, Sequence

import torch
from torch import nn

from selfextend.generation.products import activation_name, blocks_bias, head_norms, norm_factors
from selfextend.kv.cache import ContextShiftCache
from selfextend.kv.layers import CellLayer
from selfextend.models.blocks import BlockLinear
from selfextend.native.decode import CELL_FIELDS, GATED, NativeKernels
from selfextend.native.guard import address
from selfextend.native.quant import QuantKernels

MAX_PARTS = 3  # runs of one type in a fused projection (decode.c's MAX_PARTS)
FIELDS = CELL_FIELDS  # int64 values per layer and row in the cells table (decode.c's R_FIELDS)
NO_GROUPED = (0,) * 6  # a row's last six fields where no key is grouped
# (i, j, cells) -> row j's grouped keys at layer i before its token's cell is claimed: (keys, n_g, (cos,
# sin)), the first n_g rows of each KV head of keys (1, Hkv, >= n_g, D) in the cells' type with contiguous
# rows, and the query's grouped rotation; None where it scores none
Grouped = Callable[[int, int, CellLayer], tuple[torch.Tensor, int, tuple[torch.Tensor, torch.Tensor]] | None]
_ptr, _long, _f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class _Blocks(ctypes.Structure):
    _fields_ = [("w", _ptr), ("n_out", _long), ("type", _long)]


class _Plan(ctypes.Structure):
    _fields_ = [
        *[(name, _ptr) for name in ("norm", "post_norm", "attn_norm", "mlp_norm", "qn", "kn", "qkv_bias")],
        *[(name, _f32) for name in ("norm_eps", "post_eps", "attn_eps", "mlp_eps", "head_eps", "scale")],
        ("n_qkv", _long),
        ("n_gu", _long),
        ("qkv", _Blocks * MAX_PARTS),
        ("gu", _Blocks * MAX_PARTS),
        ("o", _Blocks),
        ("down", _Blocks),
    ]


class _Dims(ctypes.Structure):
    _fields_ = [
        (name, _long)
        for name in ("hidden", "h", "hkv", "d", "inter", "act", "cell_type", "threads", "portable")
    ]


def _rotation(cos: torch.Tensor, sin: torch.Tensor, d: int) -> tuple[int, int, int]:
    """(cos address, sin address, size) of a rotation's factors as the cells table holds them: ValueError
    unless both are float32 of one even size of at most the head size (the C's stack rows hold ``d``)."""
    n = cos.numel()
    if n > d or n % 2 or sin.numel() != n:
        raise ValueError(f"decode_layers takes (cos, sin) of one even size <= {d}, not {n}, {sin.numel()}")
    return address(cos, torch.float32, n, "the rotation's cos"), address(sin, torch.float32, n, "its sin"), n


def _weight(w: torch.Tensor, kind: int) -> tuple[int, int, int]:
    """(address, rows, type) of a block layer's weight as a plan holds it (every byte of its rows read)."""
    return address(w, torch.uint8, w.shape[0] * w.shape[1], "a layer's blocks"), w.shape[0], kind


def _sizes_fit(
    layer: nn.Module, qkv: Sequence[nn.Module], gate_up: Sequence[nn.Module], dims: tuple[int, ...]
) -> bool:
    """Whether a layer's projections have the sizes ``decode_layers`` reads for ``dims`` (hidden, H, Hkv, D,
    intermediate), their blocks' own sizes (a block layer's sizes are its buffers')."""
    hidden, h, hkv, d, inter = dims
    o, down = layer.self_attn.o_proj, layer.mlp.down_proj
    sizes = (sum(p.out_features for p in qkv), sum(p.out_features for p in gate_up))
    return (
        sizes == ((h + 2 * hkv) * d, 2 * inter)
        and all(p.in_features == hidden for p in (*qkv, *gate_up))
        and (o.in_features, o.out_features) == (h * d, hidden)
        and (down.in_features, down.out_features) == (inter, hidden)
    )


def _blocks(layer: nn.Module, bias: bool = False) -> tuple[torch.Tensor, int] | None:
    """(blocks, kind) of a block layer whose blocks the kernel reads in place, without a bias unless
    ``bias`` (q/k/v: ``decode_layers`` adds theirs), else None."""
    if not isinstance(layer, BlockLinear) or not layer.blocks.is_contiguous():
        return None
    if layer.bias is not None and not bias:
        return None
    return layer.blocks, layer.kind


class NativeLayers:
    """``layers(x, caches, pos, rotations)``: ``x`` (M, hidden) float32 through every layer in place, row
    ``j`` at position ``pos[j]`` of ``caches[j]``. Build with :func:`native_layers`."""

    def __init__(
        self,
        native: NativeKernels,
        quant: QuantKernels,
        plans: ctypes.Array,
        dims: tuple[int, ...],
        kinds: list[str],
        windows: list[int | None],
        held: list[torch.Tensor],
    ) -> None:
        self.native, self.quant, self.plans, self.dims = native, quant, plans, dims
        self.kinds, self.windows, self._held = kinds, windows, held  # held: what the plans point into

    def __call__(
        self,
        x: torch.Tensor,
        caches: Sequence[ContextShiftCache],
        pos: Sequence[int],
        rotations: Sequence[dict[str, tuple[torch.Tensor, torch.Tensor]]],
        grouped: Grouped | None = None,
    ) -> None:
        """Each row's cell claimed at every layer, then all layers in one call; ``rotations[j]``: row ``j``'s
        flat (cos, sin) by kind of layer (what ``rope_write`` reads); ``grouped``: Self-Extend's grouped keys
        of each layer and row (cells at distance >= W only, never the token's own; full layers only, whose
        claim moves no cell). MemoryError without scratch space, ValueError for cells the attention kernel
        does not read."""
        table, held = [], []
        h, hkv, d = self.dims[1:4]
        # each row's rotation by kind as the table holds it: (cos address, sin address, size)
        factors = [{k: _rotation(c, s, d) for k, (c, s) in r.items()} for r in rotations]
        by: dict[int, tuple[torch.Tensor, tuple[int, int, int]]] = {}  # grouped rotations seen, by id(cos)
        cell_dtype = caches[0].layers[0].keys.dtype
        for i, (kind, window) in enumerate(zip(self.kinds, self.windows, strict=True)):
            for j, cache in enumerate(caches):
                cells = cache.layers[i]
                # grouped keys first: a cell claimed but not yet written must not be grouped (the grouped
                # cache rotates the written cells a few ahead of those asked for)
                found = None if grouped is None else grouped(i, j, cells)
                slot = cells.claim()
                keys, values = cells.keys, cells.values
                if keys.shape[:2] != (1, hkv) or values.shape != keys.shape or keys.shape[-1] != d:
                    raise ValueError(f"decode_layers takes cells (1, {hkv}, n, {d}), not {tuple(keys.shape)}")
                n = hkv * keys.shape[2] * d
                table.append(address(keys, cell_dtype, n, "decode_layers' keys", rows=d))
                table.append(address(values, cell_dtype, n, "decode_layers' values", rows=d))
                table += (keys.stride(1), values.stride(1), slot)
                table.append(cells.visible_from(pos[j], window))
                table += factors[j][kind]
                if found is None:
                    table += NO_GROUPED
                    continue
                k_g, n_g, (gcos, gsin) = found
                held.append(k_g)
                if (
                    k_g.shape[:2] != (1, hkv)
                    or k_g.shape[-1] != d
                    or not 0 < n_g <= min(k_g.shape[2], keys.shape[2])
                ):
                    raise ValueError(
                        f"decode_layers takes {n_g} grouped keys of (1, {hkv}, n, {d}), not {k_g.shape}"
                    )
                table += (
                    address(k_g, cell_dtype, hkv * n_g * d, "the grouped keys", rows=d),
                    n_g,
                    k_g.stride(1),
                )
                if id(gcos) not in by:  # one rotation serves every layer of its settings
                    by[id(gcos)] = gcos, _rotation(gcos, gsin, d)
                table += by[id(gcos)][1]
        # (layers, rows, FIELDS); through array: torch.tensor reads a list of ints at ~0.1 us each
        buffer = array.array("q", table)  # referenced until the call returns
        cells_table = torch.frombuffer(buffer, dtype=torch.int64).view(len(self.kinds), len(caches), FIELDS)
        cell_type = self.native.cell_type(caches[0].layers[0].keys)
        dims = _Dims(*self.dims, cell_type, torch.get_num_threads(), int(self.quant.portable))
        failed = self.native.decode_layers(
            self.plans, len(self.kinds), dims, cells_table, x, self.quant.address
        )
        if failed == 1:
            raise MemoryError(f"decode_layers: no scratch space for {x.shape[0]} rows")
        if failed:
            raise ValueError("decode_layers: the attention kernel cannot read these cells")


def native_layers(
    layers: Sequence[nn.Module],
    qkv: Sequence[tuple[nn.Module, ...]],
    gate_up: Sequence[tuple[nn.Module, ...]],
    heads: Sequence[int],
    kinds: list[str],
    windows: list[int | None],
    native: NativeKernels | None,
    quant: QuantKernels | None,
) -> NativeLayers | None:
    """The layers as one native call, or None where a part is not what ``decode_layers`` computes: a
    projection that is not a GGUF block layer or has a bias other than q/k/v's, a norm that is not a known
    float32 RMSNorm, an activation it does not have, head norms the rotation cannot apply, or no kernels
    built. ``qkv``, ``gate_up``: each layer's fused projections as the decode step holds them (the same
    parts, the same order); ``heads``: (H, Hkv, Hkv)."""
    if native is None or quant is None or not layers:
        return None
    plans, held, act = (_Plan * len(layers))(), [], None
    d = layers[0].self_attn.head_dim
    h, hkv, _ = heads
    attn0, mlp0 = layers[0].self_attn, layers[0].mlp
    if not (isinstance(attn0.o_proj, BlockLinear) and isinstance(mlp0.down_proj, BlockLinear)):
        return None
    hidden, inter = attn0.o_proj.out_features, mlp0.down_proj.in_features
    for plan, layer, qkv_parts, gu_parts in zip(plans, layers, qkv, gate_up, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        post = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
        norms = [norm_factors(m, torch.float32) for m in (layer.input_layernorm, post)]
        outputs = [layer.post_attention_layernorm, layer.post_feedforward_layernorm] if gemma else []
        output_norms = [norm_factors(m, torch.float32) for m in outputs]
        hn = head_norms(attn, torch.float32)
        weights = [_blocks(m, bias=True) for m in qkv_parts]
        weights += [_blocks(m) for m in (*gu_parts, attn.o_proj, mlp.down_proj)]
        name = activation_name(mlp)
        if (
            None in norms + output_norms + weights
            or (hasattr(attn, "q_norm") and hn is None)
            or name not in GATED
            or act not in (None, GATED[name])
            or max(len(qkv_parts), len(gu_parts)) > MAX_PARTS
            or not _sizes_fit(layer, qkv_parts, gu_parts, (hidden, h, hkv, d, inter))
            or any(w.shape != (hidden,) for w, _ in norms + output_norms)
        ):
            return None
        act = GATED[name]
        (plan.norm, plan.norm_eps), (plan.post_norm, plan.post_eps) = [
            (address(w, torch.float32, hidden, "a layer's norm"), e) for w, e in norms
        ]
        held += [w for w, _ in norms + output_norms]
        if gemma:
            (plan.attn_norm, plan.attn_eps), (plan.mlp_norm, plan.mlp_eps) = [
                (address(w, torch.float32, hidden, "an output norm"), e) for w, e in output_norms
            ]
        if hn is not None:
            plan.qn, plan.kn = (address(w, torch.float32, d, "a head norm") for w in (hn.query, hn.key))
            plan.head_eps = hn.eps
            held += [hn.query, hn.key]
        plan.scale = attn.scaling
        bias = blocks_bias(qkv_parts)  # ((H + 2 Hkv) * D,) float32 in the fused order, or None
        if bias is not None:
            plan.qkv_bias = address(bias, torch.float32, (h + 2 * hkv) * d, "the q/k/v bias")
            held.append(bias)
        blocks = iter(weights)
        for field, parts in (("qkv", qkv_parts), ("gu", gu_parts)):
            setattr(plan, f"n_{field}", len(parts))
            for k in range(len(parts)):
                getattr(plan, field)[k] = _Blocks(*_weight(*next(blocks)))
        for field in ("o", "down"):
            setattr(plan, field, _Blocks(*_weight(*next(blocks))))
        held += [w for w, _ in weights]
    return NativeLayers(native, quant, plans, (hidden, h, hkv, d, inter, act), kinds, windows, held)
