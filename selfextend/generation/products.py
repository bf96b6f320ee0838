"""The decode step's products and norms with the fewest torch calls for a single token.

A quantized layer's ``forward`` reshapes, converts its input to bfloat16, checks its buffers are
contiguous, multiplies, converts back and reshapes again: seven dispatches around one kernel, 120 times
per token for SmolLM2, which cost more than a millisecond per token on two cores. For one row (1, K), the
same kernel on the same bfloat16 row is called directly here and its bfloat16 output handed on as it is
(the next consumer converts or adds it with promotion: the same numbers). Likewise a Llama-style RMSNorm
in float32 is ``torch.nn.functional.rms_norm`` (one fused op; equal to the module's forward).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from selfextend.models.quantize import INT4_GROUP, Int4Linear, Int8Linear

Fn = Callable[[torch.Tensor], torch.Tensor]
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")  # weight * x / rms(x), in float32


def project(parts: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor:
    """The outputs of the projections ``parts`` (a fused one, or several) side by side."""
    return parts[0].forward(x) if len(parts) == 1 else torch.cat([p.forward(x) for p in parts], dim=-1)


def product_of(parts: tuple[nn.Module, ...]) -> Fn:
    """``x (1, K) -> (1, N)``: the int4 or int8 kernel called directly (bfloat16 out) for one bias-less
    quantized layer with contiguous buffers, else the modules' forwards (out in ``x``'s type)."""
    layer = parts[0]
    if len(parts) == 1 and getattr(layer, "bias", None) is None:
        if (
            isinstance(layer, Int4Linear)
            and layer.weight_int4.is_contiguous()
            and layer.scales_zeros.is_contiguous()
        ):
            w, sz = layer.weight_int4, layer.scales_zeros
            return lambda x: torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w, INT4_GROUP, sz)
        if isinstance(layer, Int8Linear) and layer.weight_int8.device.type == "cpu":
            w, scale = layer.weight_int8, layer.scale
            return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), w, scale)
    return lambda x: project(parts, x)


def norm_of(module: nn.Module, dtype: torch.dtype) -> Fn:
    """``x (1, hidden) -> (1, hidden)``: one fused op for a Llama-style RMSNorm over ``dtype`` float32, else
    the module's forward."""
    weight = getattr(module, "weight", None)
    if type(module).__name__ in RMS_NORMS and dtype == torch.float32 and weight is not None:
        shape, eps = (weight.shape[0],), module.variance_epsilon
        return lambda x: F.rms_norm(x, shape, weight, eps)
    return module.forward
