"""The decode step's products, norms and activation with the fewest torch calls for a single token.

A quantized layer's ``forward`` reshapes, converts its input to bfloat16, checks its buffers are
contiguous, multiplies, converts back and reshapes again: seven dispatches around one kernel, 120 times
per token for SmolLM2, which cost more than a millisecond per token on two cores. For one row (1, K), the
same kernel on the same bfloat16 row is called directly here and its bfloat16 output handed on as it is
(the next consumer converts or adds it with promotion: the same numbers). Likewise an RMSNorm in float32
(Llama's, or Gemma's by ``1 + weight``) is ``torch.nn.functional.rms_norm`` (one fused op; equal to the
module's forward), and where the native kernels are built (:mod:`selfextend.native.decode`) the norm
before a quantized product and the gated activation (SwiGLU, GeGLU) between two are one call each that
hands on the bfloat16 row the product takes (float32 inside, summed in another order than torch: equal
to rounding), Gemma's norm of an attention or MLP output is added to the residual in the same call, and
an int8 product of one row is the native one (torch's reads a large output head at a third of the
bandwidth). GGUF block layers with a bias (Qwen2's q/k/v) are served directly too: the product rounded to
bfloat16 as for the others, then ``float32(product) + bias`` in float32 (one rounding), out in float32:
the arithmetic ``decode.c``'s ``decode_layers`` does where it makes a token's q/k/v rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from selfextend.models.blocks import BlockLinear
from selfextend.models.quantize import INT4_GROUP, Int4Linear, Int8Linear
from selfextend.native.decode import GATED, HeadNorms, NativeKernels
from selfextend.native.quant import QuantKernels, quant_kernels

Fn = Callable[[torch.Tensor], torch.Tensor]
Add = Callable[[torch.Tensor, torch.Tensor], None]  # (x, y): x += f(y) in place
# the RMSNorms of the decode step's families: x / rms(x) times weight (False) or times 1 + weight (True)
RMS_NORMS = {
    "LlamaRMSNorm": False,
    "MistralRMSNorm": False,
    "Qwen2RMSNorm": False,
    "Qwen3RMSNorm": False,
    "Gemma3RMSNorm": True,
}


def norm_factors(module: nn.Module | None, dtype: torch.dtype) -> tuple[torch.Tensor, float] | None:
    """(factors (n,) float32, eps) of a known RMSNorm over ``dtype`` float32: it computes
    ``factors * (x / rms(x))`` (Gemma's factors are ``1 + weight``, made here once); else None."""
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    if name not in RMS_NORMS or dtype != torch.float32 or weight is None or weight.dtype != torch.float32:
        return None
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    return (1.0 + weight if RMS_NORMS[name] else weight).detach().contiguous(), float(eps)


def fuse_float(projections: list[nn.Module]) -> nn.Linear | None:
    """One ``nn.Linear`` over float projections' weights side by side (q/k/v, or gate/up), each
    projection's own weight (and bias) re-pointed at its rows of it: views, so no second copy and the same
    values, the model's modules and their forwards unchanged. Only where the fused step kernels run (a
    GPU: a product is a launch, and a small one, such as an 8B model's 8 MB k or v projection, reads below
    the memory's rate), for plain layers of one type and device; else None (the CPU keeps its modules)."""
    from selfextend.core.fused_prefill import kernels_run_on

    first = projections[0]
    same = all(
        type(p) is nn.Linear
        and p.weight.dtype == first.weight.dtype
        and p.weight.device == first.weight.device
        and p.in_features == first.in_features
        and (p.bias is None) == (first.bias is None)
        for p in projections
    )
    if not same or first.weight.device.type == "meta" or not kernels_run_on(first.weight.device):
        return None
    with torch.no_grad():
        weight = torch.cat([p.weight for p in projections])  # (N, K)
        bias = None if first.bias is None else torch.cat([p.bias for p in projections])
        at = 0
        for p in projections:
            n = p.out_features
            p.weight.data = weight[at : at + n]
            if bias is not None:
                p.bias.data = bias[at : at + n]
            at += n
    fused = nn.Linear(first.in_features, weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def project(parts: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor:
    """The outputs of the projections ``parts`` (a fused one, or several) side by side."""
    return parts[0].forward(x) if len(parts) == 1 else torch.cat([p.forward(x) for p in parts], dim=-1)


def direct(parts: tuple[nn.Module, ...]) -> bool:
    """Whether :func:`product_of` calls a quantized kernel directly (bfloat16 in; out bfloat16, or float32
    for block layers with a bias: :func:`blocks_bias`) for ``parts``."""
    layer = parts[0]
    if all(isinstance(p, BlockLinear) for p in parts):
        return quant_kernels() is not None
    if len(parts) != 1 or getattr(layer, "bias", None) is not None:
        return False
    if isinstance(layer, Int4Linear):
        w, sz = layer.weight_int4, layer.scales_zeros
        return w.device.type == "cpu" and w.is_contiguous() and sz.is_contiguous()
    return isinstance(layer, Int8Linear) and layer.weight_int8.device.type == "cpu"


def product_of(parts: tuple[nn.Module, ...], native: NativeKernels | None = None, logits: bool = False) -> Fn:
    """``x (1, K) -> (1, N)``: the int4 or int8 kernel called directly (bfloat16 out) for one bias-less
    quantized layer with contiguous buffers (int8: the native one where ``native`` is given), the native
    GGUF block product for block layers (several: side by side; a bias added as :func:`blocks_product`
    says), else the modules' forwards (out in ``x``'s type). ``logits``: ``parts`` is the output layer,
    whose block product is float32 out, as the model's forward and llama.cpp give logits: in bfloat16 two
    logits near 25 are 0.125 apart, so near-ties fell to the lower id."""
    layer = parts[0]
    if direct(parts) and isinstance(layer, BlockLinear):
        return blocks_product(parts, quant_kernels(), torch.float32 if logits else torch.bfloat16)
    if direct(parts) and isinstance(layer, Int4Linear):
        w, sz = layer.weight_int4, layer.scales_zeros
        return lambda x: torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w, INT4_GROUP, sz)
    if direct(parts):
        w, scale = layer.weight_int8, layer.scale
        if native is not None and w.is_contiguous() and scale.is_contiguous():
            return lambda x: native.int8_gemv(x.contiguous(), w, scale)
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), w, scale)
    return lambda x: project(parts, x)


def each(fn: Fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` (a norm or activation of one row) on each row of ``x`` (M, n): the lone token's numbers."""
    return fn(x) if x.shape[0] == 1 else torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])


def each_add(add: Add, x: torch.Tensor, y: torch.Tensor) -> None:
    """``add(x, y)`` (in place into ``x``) row by row, as a lone token's."""
    if x.shape[0] == 1:
        return add(x, y)
    for i in range(x.shape[0]):
        add(x[i : i + 1], y[i : i + 1])


def blocks_product(
    parts: tuple[BlockLinear, ...], kernels: QuantKernels, out_dtype: torch.dtype = torch.bfloat16
) -> Fn:
    """``x (M, K) -> (M, N)``: the block layers' products in ``out_dtype``, side by side where there are
    several (of different types: a Q4_K_M file's v projection is Q6_K); where a part has a bias,
    ``float32(y) + bias`` (:func:`blocks_bias`), float32 out."""
    held = [(p.blocks.contiguous(), p.kind) for p in parts]
    bias = blocks_bias(parts)

    def product(x: torch.Tensor) -> torch.Tensor:
        ys = [kernels(x, b, k, out_dtype) for b, k in held]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if bias is None else y.float().add_(bias)

    return product


def blocks_bias(parts: tuple[nn.Module, ...]) -> torch.Tensor | None:
    """The biases of ``parts`` side by side (N,) float32 contiguous (zeros for a part without one), or None
    where no part has one: what the decode step adds, in float32, to the float32 of the bfloat16 product."""
    biases = [getattr(p, "bias", None) for p in parts]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            torch.zeros(p.out_features) if b is None else b.detach().float().reshape(-1)
            for p, b in zip(parts, biases, strict=True)
        ]
    ).contiguous()


def norm_of(module: nn.Module, dtype: torch.dtype, native: NativeKernels | None = None) -> Fn:
    """``x (1, hidden) -> (1, hidden)``: for a known RMSNorm (:func:`norm_factors`) over ``dtype`` float32,
    the native norm rounded to bfloat16 where ``native`` is given, else one fused op; anything else, the
    module's forward."""
    found = norm_factors(module, dtype)
    if found is None:
        return module.forward
    factors, eps = found
    if native is not None:
        return lambda x: native.rms_norm_bf16(x, factors, eps)
    return lambda x: F.rms_norm(x, factors.shape, factors, eps)


def residual_of(module: nn.Module | None, dtype: torch.dtype, native: NativeKernels | None) -> Add:
    """``(x, y) -> None``: ``x += norm(y)`` for a norm ``module`` (Gemma's after attention and MLP), natively
    where ``native`` is given, or ``x += y`` where there is none."""
    if module is None:
        return torch.Tensor.add_
    found = norm_factors(module, dtype)
    if found is not None and native is not None:
        factors, eps = found
        return lambda x, y: native.rms_norm_add(x, y, factors, eps)
    norm = norm_of(module, dtype)
    return lambda x, y: x.add_(norm(y.to(dtype)))


def head_norms(attn: nn.Module, dtype: torch.dtype) -> HeadNorms | None:
    """The attention's query and key head norms (Qwen3, Gemma 3) as the native ``rope_write`` applies them,
    or None where it has none or they are not known RMSNorms over float32 of one head's size."""
    q, k = (norm_factors(getattr(attn, name, None), dtype) for name in ("q_norm", "k_norm"))
    if q is None or k is None or q[1] != k[1]:
        return None
    norms = HeadNorms(q[0], k[0], q[1])
    return norms if norms.fits(attn.head_dim) else None


def activation_of(
    mlp: nn.Module, gate_up: tuple[nn.Module, ...], dtype: torch.dtype, native: NativeKernels | None
) -> Fn:
    """``[gate, up] (1, 2I) -> act(gate) * up (1, I)``: natively, rounded to bfloat16, after a direct
    product where ``native`` is given and has ``mlp``'s activation; else in ``dtype`` by ``mlp.act_fn``."""
    name = activation_name(mlp)
    if native is not None and direct(gate_up) and blocks_bias(gate_up) is None and name in GATED:
        return lambda y: native.gated_bf16(y, name)

    def act(y: torch.Tensor) -> torch.Tensor:
        gate, up = y.to(dtype).chunk(2, dim=-1)
        return mlp.act_fn(gate) * up

    return act


def activation_name(mlp: nn.Module) -> str | None:
    """transformers' name of ``mlp``'s activation (``silu``, ``gelu_pytorch_tanh``, ...), from its config."""
    config = getattr(mlp, "config", None)
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


class LayerPlan(NamedTuple):
    """One decoder layer's norms, products and activation as the decode step calls them: ``x +=
    attention(norm(x))`` then ``x += mlp(post_norm(x))``, each added through ``add_attention`` and ``add_mlp``
    (a norm first in Gemma); ``head_norms``: the q/k norms the native rotation applies (Qwen3, Gemma 3)."""

    norm: Fn
    qkv: Fn
    head_norms: HeadNorms | None
    o_proj: Fn
    add_attention: Add
    post_norm: Fn
    gate_up: Fn
    act: Fn
    down_proj: Fn
    add_mlp: Add

    @classmethod
    def of(
        cls,
        layer: nn.Module,
        qkv: tuple[nn.Module, ...],
        gate_up: tuple[nn.Module, ...],
        dtype: torch.dtype,
        native: NativeKernels | None,
    ) -> LayerPlan:
        """The plan of a Llama- or Gemma-style ``layer`` with its fused ``qkv`` and ``gate_up`` projections;
        the native norm only before a direct product (the others take float rows)."""
        before = (native if direct(qkv) else None, native if direct(gate_up) else None)
        gemma = hasattr(layer, "pre_feedforward_layernorm")  # norms after attention and MLP too
        post = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
        return cls(
            norm_of(layer.input_layernorm, dtype, before[0]),
            product_of(qkv, native),
            head_norms(layer.self_attn, dtype),
            product_of((layer.self_attn.o_proj,), native),
            residual_of(layer.post_attention_layernorm if gemma else None, dtype, native),
            norm_of(post, dtype, before[1]),
            product_of(gate_up, native),
            activation_of(layer.mlp, gate_up, dtype, native),
            product_of((layer.mlp.down_proj,), native),
            residual_of(layer.post_feedforward_layernorm if gemma else None, dtype, native),
        )
