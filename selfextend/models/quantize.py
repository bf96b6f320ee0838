"""Weight-only int8 linear layers: a quarter of float32's bytes per generated token.

Decoding one token reads every weight once, so on a CPU it is bound by memory bandwidth, not
arithmetic, and int8 weights are a quarter of float32's bytes to read. Each output row
of a weight is stored as int8 with one symmetric scale (``w ~= q * scale``, ``|q| <= 127``).
The matrix products run in bfloat16 with float32 accumulation: for a few rows (decoding) in
torch's fused int8 x bfloat16 kernel, which reads the int8 weight directly; for many rows
(prefill) as a bfloat16 GEMM on the weight dequantised for that call. Both paths compute the
same products, so prefill and decode agree. Everything else (norms, RoPE, attention, the KV
cache, the residual stream) keeps the model's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

WEIGHT_FORMATS = ("float", "int8")
FUSED_MAX_ROWS = 16  # up to this many input rows the fused int8 kernel beats dequantise + GEMM


def quantize_rows(weight: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float weight -> (N, K) int8 and (N,) float32 scales, symmetric per row.

    ``block`` rows at a time, rounded in place, so the float32 temporaries stay small next to a large
    weight (Gemma 3's 262k-row output head would otherwise need three float32 copies of 671 MB at once).
    """
    w = weight.detach()
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for a in range(0, w.shape[0], block):
        rows = w[a : a + block].float()  # (block, K)
        s = rows.abs().amax(dim=1).clamp(min=1e-12) / 127
        q[a : a + block] = (rows / s[:, None]).round_().clamp_(-127, 127)
        scale[a : a + block] = s
    return q, scale


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored as per-row int8 and computed in bfloat16 (see module doc)."""

    def __init__(
        self, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 version of ``linear`` (its own copy; ``linear`` is left as it is)."""
        q, scale = quantize_rows(linear.weight)
        bias = linear.bias
        return cls(q, scale, None if bias is None else bias.detach().clone())

    def dequantized(self) -> torch.Tensor:
        """The (N, K) bfloat16 weight this layer multiplies by."""
        return self.weight_int8.to(torch.bfloat16) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (M, K)
        if rows.shape[0] <= FUSED_MAX_ROWS and rows.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scale)  # (M, N)
        else:
            y = nn.functional.linear(rows, self.dequantized())
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


def quantize_int8(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` (the output head included) by :class:`Int8Linear`.

    In place; embeddings, norms and everything else stay as they are. Returns how many layers
    were replaced. A tied output head gets its own int8 copy; the embedding keeps its weight.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_linear(child))
                replaced += 1
    return replaced


def weight_format(model: nn.Module) -> str:
    """``int8`` when :func:`quantize_int8` has run on ``model``, else ``float``."""
    return "int8" if any(isinstance(m, Int8Linear) for m in model.modules()) else "float"


def fuse_int8(layers: Sequence[Int8Linear]) -> Int8Linear:
    """One layer computing the outputs of ``layers`` (which take the same input) side by side.

    One matrix product instead of several saves per-call overhead while decoding. The fused
    layer owns the storage and the given layers keep working as views into it, so no weight is
    held twice. A missing bias counts as zeros when another layer has one.
    """
    if len({m.in_features for m in layers}) != 1:
        raise ValueError("layers to fuse must share their input size")
    weight = torch.cat([m.weight_int8 for m in layers])
    scale = torch.cat([m.scale for m in layers])
    bias = None
    biases = [m.bias for m in layers if m.bias is not None]
    if biases:
        bias = torch.cat([biases[0].new_zeros(m.out_features) if m.bias is None else m.bias for m in layers])
    fused = Int8Linear(weight, scale, bias)
    start = 0
    for m in layers:
        rows = slice(start, start + m.out_features)
        m.weight_int8, m.scale = weight[rows], scale[rows]
        if m.bias is not None:
            m.bias = bias[rows]
        start = rows.stop
    return fused
