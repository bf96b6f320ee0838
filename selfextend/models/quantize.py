"""Weight-only int8 and int4 linear layers: a quarter (an eighth) of float32's bytes per generated token.

Decoding one token reads every weight once, so on a CPU it is bound by memory bandwidth, not
arithmetic, and int8 weights are a quarter of float32's bytes to read. Each output row
of a weight is stored as int8 with one symmetric scale (``w ~= q * scale``, ``|q| <= 127``).
The matrix products run in bfloat16 with float32 accumulation: for a few rows (decoding) in
torch's fused int8 x bfloat16 kernel, which reads the int8 weight directly; for many rows
(prefill) as a bfloat16 GEMM on the weight dequantised for that call. Both paths compute the
same products, so prefill and decode agree. Everything else (norms, RoPE, attention, the KV
cache, the residual stream) keeps the model's dtype.

Int4 layers (:class:`Int4Linear`) are never quantised here: they are repacked from a GGUF's own 4-bit
blocks (Q4_0, Q4_1, Q4_K), whose groups of 32 values with a scale and an offset are exactly the
groups of torch's CPU int4 kernel, so no value is rounded again (the scales are held in bfloat16).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from selfextend.models.blocks import BlockLinear

WEIGHT_FORMATS = ("float", "int8", "int4", "gguf")
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
    """``gguf`` when some linear layer holds a GGUF's blocks as stored, ``int4`` when some holds 4-bit
    weights, ``int8`` when some holds int8 ones (as :func:`quantize_int8` makes them), else ``float``."""
    kinds = {type(m) for m in model.modules()}
    for kind, form in ((BlockLinear, "gguf"), (Int4Linear, "int4"), (Int8Linear, "int8")):
        if kind in kinds:
            return form
    return "float"


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
    bias = _fused_bias(layers)
    fused = Int8Linear(weight, scale, bias)
    start = 0
    for m in layers:
        rows = slice(start, start + m.out_features)
        m.weight_int8, m.scale = weight[rows], scale[rows]
        if m.bias is not None:
            m.bias = bias[rows]
        start = rows.stop
    return fused


def _fused_bias(layers: Sequence[nn.Module]) -> torch.Tensor | None:
    """The biases of ``layers`` side by side (a missing one as zeros), or None when none has one."""
    biases = [m.bias for m in layers if m.bias is not None]
    if not biases:
        return None
    return torch.cat([biases[0].new_zeros(m.out_features) if m.bias is None else m.bias for m in layers])


INT4_GROUP = 32  # elements per scale of torch's CPU int4 kernel here, and of every GGUF 4-bit sub-block
Q4_0, Q4_1, Q4_K = 2, 3, 12  # gguf.GGMLQuantizationType values of the 4-bit formats repacked
INT4_KINDS = (Q4_0, Q4_1, Q4_K)
_PACK_ROWS = 1024  # rows packed at a time: a multiple of the int4 packing's 64-row blocks


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block (..., bytes) as float32 (...,)."""
    return raw[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def int4_blocks(kind: int, raw: np.ndarray, columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF 4-bit tensor's rows (N, bytes per row, uint8) -> ``q`` (N, K) int32 in [0, 16) and ``scale``,
    ``zero`` (N, K / 32) float32 with ``w = (q - 8) * scale + zero``: the form of torch's int4 kernel.

    Q4_0 (``w = (q - 8) d``), Q4_1 (``w = q d + m``) and Q4_K (super-blocks of 256 with 6-bit sub-block
    scales and mins, ``w = q d sc - dmin m``) all use sub-blocks of 32, so no value is re-quantised.
    """
    rows = raw.shape[0]
    if kind in (Q4_0, Q4_1):
        blocks = raw.reshape(rows, columns // 32, -1)  # (N, K / 32, 18 or 20)
        qs = blocks[..., -16:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # (N, K / 32, 32): low nibbles first
        d = _f16(blocks, 0)
        zero = np.zeros_like(d) if kind == Q4_0 else _f16(blocks, 2) + 8 * d
        return q.reshape(rows, columns).astype(np.int32), d, zero
    if kind != Q4_K:
        raise ValueError(f"GGUF type {kind} is not a 4-bit block format this repacks (Q4_0, Q4_1, Q4_K)")
    blocks = raw.reshape(rows, columns // 256, 144)  # (N, K / 256, 144)
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    sc6 = blocks[..., 4:16].astype(np.int32)  # (N, K / 256, 12): 8 scales and 8 mins of 6 bits
    low, high = sc6[..., :4], sc6[..., 4:8]
    sc = np.concatenate([low & 63, (sc6[..., 8:] & 0xF) | ((low >> 6) << 4)], axis=-1)  # (N, K / 256, 8)
    m = np.concatenate([high & 63, (sc6[..., 8:] >> 4) | ((high >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(rows, columns // 256, 4, 32)  # 4 chunks of 64 values, 2 sub-blocks each
    q = np.stack([qs & 0xF, qs >> 4], axis=3)  # (N, K / 256, 4, 2, 32): sub-block 2j, then 2j + 1
    scale = (d * sc).astype(np.float32)  # (N, K / 256, 8)
    zero = (8 * scale - dmin * m).astype(np.float32)
    return q.reshape(rows, columns).astype(np.int32), scale.reshape(rows, -1), zero.reshape(rows, -1)


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` in torch's CPU int4 layout: 4-bit values in groups of 32 along the input,
    each group with a bfloat16 scale and zero (``w = (q - 8) * scale + zero``), products in bfloat16.

    One kernel for any number of rows: it keeps up with a bfloat16 GEMM on prefill-sized inputs, so
    prefill and decode compute the same products. Built from already-packed buffers (:meth:`from_gguf`
    packs them), so a saved layer loads without repacking.
    """

    def __init__(
        self, weight_int4: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.out_features = weight_int4.shape[0]
        self.in_features = 2 * weight_int4.shape[1]
        self.register_buffer("weight_int4", weight_int4)  # (N, K / 2) uint8, in blocks of 64 rows
        self.register_buffer("scales_zeros", scales_zeros)  # (K / 32, N, 2) bfloat16
        self.register_buffer("bias", bias)

    @classmethod
    def from_gguf(cls, kind: int, raw: np.ndarray, columns: int) -> Int4Linear:
        """From a GGUF tensor's stored rows (N, bytes per row) of type ``kind`` (:func:`int4_blocks`), a
        block of rows at a time: the int32 values of the whole weight never exist at once."""
        rows = raw.shape[0]
        packed = torch.empty(rows, columns // 2, dtype=torch.uint8)
        scales_zeros = torch.empty(columns // INT4_GROUP, rows, 2, dtype=torch.bfloat16)
        for a in range(0, rows, _PACK_ROWS):
            q, scale, zero = (
                torch.from_numpy(x) for x in int4_blocks(kind, raw[a : a + _PACK_ROWS], columns)
            )
            b = a + q.shape[0]
            packed[a:b] = torch._convert_weight_to_int4pack_for_cpu(q, 1)
            scales_zeros[:, a:b] = torch.stack([scale.T, zero.T], dim=-1)
        return cls(packed, scales_zeros)

    def dequantized(self) -> torch.Tensor:
        """The (N, K) bfloat16 weight this layer multiplies by (the product with the identity)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.weight_int4.device)
        return self._product(eye).T

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        # contiguous: the kernel silently misreads a strided view (the buffers of a fused layer's parts)
        return torch._weight_int4pack_mm_for_cpu(
            rows, self.weight_int4.contiguous(), INT4_GROUP, self.scales_zeros.contiguous()
        )  # (M, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x.reshape(-1, self.in_features).to(torch.bfloat16))  # (M, K) -> (M, N)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of 32"


def int4_packable(kind: int, rows: int, columns: int) -> bool:
    """Whether a GGUF weight of type ``kind`` and (rows, columns) goes into :class:`Int4Linear` as it is
    stored: a 4-bit block format, and a shape the int4 packing takes (rows a multiple of 16)."""
    return kind in INT4_KINDS and rows % 16 == 0 and columns % INT4_GROUP == 0


def fuse_int4(layers: Sequence[Int4Linear]) -> Int4Linear | None:
    """:func:`fuse_int8` for int4 layers; None when they cannot be fused without repacking (an output
    size before the last that is not a multiple of the packing's 64-row blocks)."""
    if len({m.in_features for m in layers}) != 1 or any(m.out_features % 64 for m in layers[:-1]):
        return None
    weight = torch.cat([m.weight_int4 for m in layers])
    scales_zeros = torch.cat([m.scales_zeros for m in layers], dim=1)
    fused = Int4Linear(weight, scales_zeros, _fused_bias(layers))
    start = 0
    for m in layers:
        rows = slice(start, start + m.out_features)
        m.weight_int4, m.scales_zeros = weight[rows], scales_zeros[:, rows]
        if m.bias is not None:
            m.bias = fused.bias[rows]
        start = rows.stop
    return fused
