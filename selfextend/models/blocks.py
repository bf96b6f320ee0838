"""Linear layers holding a GGUF tensor's quantized blocks as the file stores them (``--weights gguf``).

Why: a token's decode reads every weight once, so the bytes read per token are what the layers hold. As
stored, a Q4_K_M file's layers are 4.5 to 6.6 bits a weight, with nothing rounded again (int8 would hold
a Q6_K output head in 1.23x its bytes; torch's int4 packing takes only the 4-bit formats, and its
kernel reads them far below the bandwidth). The product is ``torch.ops.selfextend.block_mm``, a custom op
(torch.compile takes it as one node): the native kernel of :mod:`selfextend.native.quant`, else (no C
compiler, ``$SELFEXTEND_NATIVE=0``) a reference of the same weights, slow: the blocks dequantised by
``gguf`` a slab of rows at a time, then a float32 product.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from selfextend.native.blocktypes import BLOCK_KINDS, INTERLEAVED, base_kind, block_shape
from selfextend.native.quant import chunk_engine, quant_kernels

_SLAB_ROWS = 256  # rows dequantised at a time by the reference product
F16 = 1  # gguf's F16 code: the type of a block layer's (meta) placeholder, until its blocks come
BF16_MIN_ROWS = 128  # rows from which a call takes a layer's bf16 chunk engine (a tile's dequantisation pays)


# The forms whose blocks are interleaved in whole pieces (Q8_0 and the K-quants): the pieces of a stored
# block, (offset, bytes), in the order the group block holds them, as kquant.c's kx8_piece and legacy.c's
# Q8_0X8 read them. Q6_K's are in the order its loop reads them (scales; per 4 values of each half's 32
# positions, the two ql words and the qh word; d), so that a group's super-block is read front to back.
PIECES = {
    8: ((0, 2), (2, 32)),  # Q8_0: d, qs
    12: ((0, 2), (2, 2), (4, 12), (16, 128)),  # Q4_K: d, dmin, scales, qs
    13: ((0, 2), (2, 2), (4, 12), (16, 32), (48, 128)),  # Q5_K: d, dmin, scales, qh, qs
    14: (
        (192, 16),
        *(
            (at, 4)
            for h in (0, 1)
            for g in range(8)
            for at in (64 * h + 4 * g, 64 * h + 32 + 4 * g, 128 + 32 * h + 4 * g)
        ),
        (208, 2),
    ),  # Q6_K: scales, (ql, ql, qh) words, d
}


def _head(kind: int) -> int:
    """Bytes before the packed values in a block of Q4_0 (d) or Q4_1 (d, m)."""
    return 4 if base_kind(kind) == 3 else 2


def _pieces(r: np.ndarray, kind: int, pack: bool) -> np.ndarray:
    """Blocks (G, 8 rows, blocks, bytes) of a :data:`PIECES` type as groups (G, blocks, 8 x bytes), each
    piece's 4-byte words (a float16 scale's 2) of the 8 rows side by side (``pack``), or such groups (G,
    blocks, 8 x bytes) back to (G, 8, blocks, bytes)."""
    pieces = PIECES[base_kind(kind)]
    if pack:  # each piece (G, 8, nb, words, z) -> (G, nb, words, row, z)
        parts = [
            r[..., at : at + size]
            .reshape(*r.shape[:3], size // min(size, 4), min(size, 4))
            .transpose(0, 2, 3, 1, 4)
            for at, size in pieces
        ]
        return np.concatenate([f.reshape(r.shape[0], r.shape[2], -1) for f in parts], axis=-1)
    out = np.empty((r.shape[0], 8, r.shape[1], r.shape[2] // 8), dtype=r.dtype)
    start = 0
    for at, size in pieces:  # (G, nb, words, row, z) -> (G, 8, nb, words, z)
        z = min(size, 4)
        f = r[..., start : start + 8 * size].reshape(*r.shape[:2], size // z, 8, z).transpose(0, 3, 1, 2, 4)
        out[..., at : at + size] = f.reshape(r.shape[0], 8, r.shape[1], size)
        start += 8 * size
    return out


def pack8(raw: np.ndarray, kind: int) -> np.ndarray:
    """Q4_0, Q4_1, Q8_0 or K-quant rows (N, bytes per row), N a multiple of 8, in the kernels' 8-row
    interleaved form, the same bytes rearranged: per group of 8 rows and block, Q4_0 and Q4_1: the 8
    rows' d, (Q4_1) their 8 m, then 128 bytes where byte 16 s + 4 k + i holds value 4 s + i of row k (low
    nibble) and of row 4 + k (high); Q8_0 and the K-quants: each piece of the block (:data:`PIECES`) in
    turn, as the 8 rows' words of 4 bytes (float16 scales: 2) side by side, word w of row k at 8 o + 8 z w
    + z k (o the bytes of the pieces before it, z the word's size; Q8_0's value 4 s + i of row k at 16 +
    32 s + 4 k + i).

    Why: one 32-byte load of the (unpacked) values then holds 4 values of each of 8 rows, so an integer
    product's 8 lanes are 8 outputs, summed over a whole block before one conversion to float (3x the
    multiply rate of a row at a time on AVX2 for Q4_0; the K-quants' loops about half the instructions
    per byte; llama.cpp repacks Q4_0 and the K-quants for the same reason)."""
    (_, size), n = block_shape(kind), raw.shape[0]
    r = raw.reshape(n // 8, 8, -1, size)  # (G, 8 rows, blocks, bytes)
    if base_kind(kind) in PIECES:
        return np.ascontiguousarray(_pieces(r, kind, pack=True)).reshape(n, -1)
    head = _head(kind)
    groups, _, nb, _ = r.shape
    qs = r[..., head:]
    v = np.concatenate([qs & 15, qs >> 4], axis=-1)  # (G, 8, nb, 32) values 0..15
    steps = [v[:, half : half + 4].reshape(groups, 4, nb, 8, 4).transpose(0, 2, 3, 1, 4) for half in (0, 4)]
    packed = (steps[0] | steps[1] << 4).reshape(groups, nb, 128)  # (G, nb, step, row, value) as bytes
    scales = (
        r[..., :head].reshape(groups, 8, nb, head // 2, 2).transpose(0, 2, 3, 1, 4)
    )  # (G, nb, d|m, row, 2)
    out = np.concatenate([scales.reshape(groups, nb, 8 * head), packed], axis=-1)
    return np.ascontiguousarray(out).reshape(n, -1)


def unpack8(packed: np.ndarray, kind: int) -> np.ndarray:
    """The rows :func:`pack8` rearranged, as the GGUF stores them."""
    (_, size), n = block_shape(kind), packed.shape[0]
    p = packed.reshape(n // 8, -1, 8 * size)  # (G, nb, group block)
    if base_kind(kind) in PIECES:
        return np.ascontiguousarray(_pieces(p, kind, pack=False)).reshape(n, -1)
    head = _head(kind)
    groups, nb, _ = p.shape
    scales = p[..., : 8 * head].reshape(groups, nb, head // 2, 8, 2).transpose(0, 3, 1, 2, 4)
    steps = p[..., 8 * head :].reshape(groups, nb, 8, 4, 4)  # (G, nb, step, row, value)
    halves = [(steps >> shift & 15).transpose(0, 3, 1, 2, 4).reshape(groups, 4, nb, 32) for shift in (0, 4)]
    v = np.concatenate(halves, axis=1)  # (G, 8, nb, 32)
    qs = v[..., :16] | v[..., 16:] << 4
    raw = np.concatenate([scales.reshape(groups, 8, nb, head), qs], axis=-1)
    return np.ascontiguousarray(raw).reshape(n, -1)


def stored(blocks: torch.Tensor, kind: int) -> tuple[np.ndarray, int]:
    """(rows as the GGUF stores them, their GGUF type) of a layer's ``blocks`` of ``kind``."""
    if kind in INTERLEAVED.values():
        return unpack8(blocks.numpy(), kind), base_kind(kind)
    return blocks.numpy(), kind


def row_values(kind: int, row_bytes: int) -> int:
    """Values in a row of ``row_bytes`` bytes of GGUF type ``kind`` (or its interleaved form): whole blocks'
    values; ValueError for bytes that are not whole blocks, or a type the kernels do not compute."""
    if base_kind(kind) not in BLOCK_KINDS:
        raise ValueError(f"GGUF type {kind} is not held as blocks")
    values, size = block_shape(kind)
    if row_bytes % size:
        raise ValueError(f"rows of {row_bytes} bytes are not whole {BLOCK_KINDS[base_kind(kind)]} blocks")
    return row_bytes // size * values


def check_blocks(blocks: torch.Tensor, kind: int, name: str) -> None:
    """ValueError naming ``name`` unless ``blocks`` are what a block layer of ``kind`` holds: (rows, bytes
    per row) uint8 of whole blocks, rows in eights for an interleaved form."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[0] < 1:
        raise ValueError(f"{name}: blocks of {tuple(blocks.shape)} {blocks.dtype}, not (rows, bytes) uint8")
    try:
        row_values(kind, blocks.shape[1])
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if kind in INTERLEAVED.values() and blocks.shape[0] % 8:
        raise ValueError(f"{name}: an interleaved form holds rows in eights, not {blocks.shape[0]}")


def block_packable(kind: int, rows: int, columns: int) -> bool:
    """Whether a GGUF weight of type ``kind`` and (rows, columns) is held as stored: a block format the
    kernels compute (:data:`BLOCK_KINDS`)."""
    return kind in BLOCK_KINDS and rows > 0 and columns % block_shape(kind)[0] == 0


def reference_product(x: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """``x (M, K) @ dequantize(blocks)^T`` in float32, a slab of weight rows at a time."""
    from gguf import dequantize

    out = torch.empty(x.shape[0], blocks.shape[0])
    raw, kind = stored(blocks, kind)
    for a in range(0, raw.shape[0], _SLAB_ROWS):
        w = torch.from_numpy(
            np.ascontiguousarray(dequantize(raw[a : a + _SLAB_ROWS], kind), dtype=np.float32)
        )
        out[:, a : a + w.shape[0]] = x @ w.T
    return out


@torch.library.custom_op("selfextend::block_mm", mutates_args=())
def block_mm(x: torch.Tensor, blocks: torch.Tensor, kind: int, bf16: bool = False) -> torch.Tensor:
    """``x (M, K) float32 @ W^T -> (M, N) float32`` for W the GGUF blocks ``blocks`` (N, bytes per row) of
    type ``kind``: the native kernel's integer products, or with ``bf16`` its bfloat16 tiles (a prefill
    chunk's engine, :func:`~selfextend.native.quant.chunk_engine`), else :func:`reference_product`."""
    kernels = quant_kernels()
    if kernels is None:
        return reference_product(x, blocks, kind)
    return kernels.tiled(x, blocks, kind) if bf16 else kernels(x, blocks, kind)


@block_mm.register_fake
def _(x: torch.Tensor, blocks: torch.Tensor, kind: int, bf16: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])


class BlockLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` the rows of a GGUF tensor's blocks of type ``kind`` as stored: ``blocks``
    (N, bytes per row) uint8. ``block_kind`` (a buffer) carries the type into the saved run form.
    ``chunk_engine`` (``int8`` or ``bf16``, :func:`~selfextend.native.quant.chunk_engine`) is how calls of
    :data:`BF16_MIN_ROWS` rows or more multiply; fewer rows always take int8. ``in_features`` and
    ``out_features`` are the blocks' own (their bytes per row and rows), never set beside them, so the
    kernels are never told of values the buffer does not hold; ``in_features`` given to the constructor
    must agree with them (ValueError otherwise)."""

    def __init__(
        self, blocks: torch.Tensor, kind: int, in_features: int, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.chunk_engine = chunk_engine()
        self.kind = kind
        if row_values(kind, blocks.shape[1]) != in_features:
            raise ValueError(f"blocks of {blocks.shape[1]} bytes a row hold no rows of {in_features} values")
        self.register_buffer("blocks", blocks)
        self.register_buffer("block_kind", torch.tensor([kind], dtype=torch.int32, device=blocks.device))
        self.register_buffer("bias", bias)

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def in_features(self) -> int:
        return row_values(self.kind, self.blocks.shape[1])

    def set_kind(self, kind: int) -> None:
        """Take ``kind`` as the blocks' type (a saved layer's ``block_kind``, read back)."""
        self.kind = int(kind)
        self.block_kind = torch.tensor([kind], dtype=torch.int32)

    def interleave(self) -> None:
        """Hold the blocks in the kernels' 8-row interleaved form (:func:`pack8`) where the rows come in
        eights and the kernels run that form faster here
        (:meth:`~selfextend.native.quant.QuantKernels.interleaves`: Q4_0, Q4_1, Q8_0, and the K-quants but
        where their stored rows' loops are faster on this CPU); others stay as stored."""
        kernels = quant_kernels()
        if kernels is not None and kernels.interleaves(self.kind) and self.out_features % 8 == 0:
            self.blocks = torch.from_numpy(pack8(self.blocks.numpy(), self.kind))
            self.set_kind(INTERLEAVED[self.kind])

    def dequantized(self) -> torch.Tensor:
        """The (N, K) float32 weight this layer multiplies by."""
        from gguf import dequantize

        return torch.from_numpy(np.ascontiguousarray(dequantize(*stored(self.blocks, self.kind))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        bf16 = self.chunk_engine == "bf16" and rows.shape[0] >= BF16_MIN_ROWS
        y = block_mm(rows, self.blocks, self.kind, bf16)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        name = BLOCK_KINDS.get(base_kind(self.kind), self.kind)
        form = ", 8 rows interleaved" if self.kind in INTERLEAVED.values() else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, GGUF {name} blocks{form}"


class TokenIdError(IndexError, ValueError):
    """A token id outside the rows an embedding table stores (an IndexError, as torch's embedding raises,
    and a ValueError, as every input the native kernels refuse)."""


class BlockEmbedding(nn.Module):
    """An embedding table held as a GGUF tensor's blocks: ``blocks`` (N, bytes per row) uint8 of type
    ``kind``, as stored or in an 8-row interleaved form (:func:`pack8`), each looked-up row dequantized to
    float32, gguf's values of the stored row bit for bit (:meth:`~selfextend.native.quant.QuantKernels.rows`,
    else ``gguf``'s dequantize).

    Why: a lookup reads a row or a chunk's rows, so the table need not be held as floats; Llama 3.2 1B's
    Q6_K table is 1,002 MiB in float32 and 200 MiB as stored. A tied output head (a :class:`BlockLinear`)
    shares the same bytes: as stored, or interleaved where :meth:`BlockLinear.interleave` rearranges them
    for a faster product (:func:`~selfextend.models.weights.fill` then gives the table the head's form, so
    that it is held once: SmolLM2's Q8_0 table 28.7 MiB, not twice that). ``embed_scale``: Gemma's
    scaled embedding's factor, applied as its module does; :meth:`lookup` gives the rows unscaled.
    ``dtype``: of the rows given (the model's float type; the values are dequantized in float32 and cast,
    as a float table is made)."""

    def __init__(
        self,
        blocks: torch.Tensor,
        kind: int,
        embedding_dim: int,
        embed_scale: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if row_values(kind, blocks.shape[1]) != embedding_dim:
            raise ValueError(
                f"blocks of {blocks.shape[1]} bytes a row hold no rows of {embedding_dim} values"
            )
        self.kind, self.dtype = kind, dtype
        self.register_buffer("blocks", blocks)
        self.register_buffer("block_kind", torch.tensor([kind], dtype=torch.int32, device=blocks.device))
        self.register_buffer("embed_scale", embed_scale, persistent=False)

    @property
    def num_embeddings(self) -> int:
        """The rows the table stores: what a lookup may read, whatever a config says."""
        return self.blocks.shape[0]

    @property
    def embedding_dim(self) -> int:
        return row_values(self.kind, self.blocks.shape[1])

    def set_kind(self, kind: int) -> None:
        """Take ``kind`` as the blocks' type (a saved table's ``block_kind``, read back)."""
        self.kind = int(kind)
        self.block_kind = torch.tensor([kind], dtype=torch.int32)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) as ``(*ids.shape, embedding_dim)`` of :attr:`dtype`, unscaled. IndexError
        (a ValueError too: :class:`TokenIdError`) for an id outside the rows the table stores."""
        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise TokenIdError(
                f"token ids must lie in [0, {self.num_embeddings}), got {int(flat.min())}..{int(flat.max())}"
            )
        kernels = quant_kernels()
        if kernels is None:
            from gguf import dequantize

            raw, kind = self._stored_rows(flat)
            rows = torch.from_numpy(dequantize(raw, kind).reshape(-1, self.embedding_dim))
        else:
            rows = kernels.rows(self.blocks, self.kind, self.embedding_dim, flat)
        return rows.reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    def _stored_rows(self, flat: torch.Tensor) -> tuple[np.ndarray, int]:
        """(rows ``flat`` as the GGUF stores them, their GGUF type): of an interleaved form, each row's group
        put back (:func:`unpack8`) and its lane (row % 8) kept."""
        if self.kind not in INTERLEAVED.values():
            return self.blocks[flat].numpy(), self.kind
        size = self.blocks.shape[1]  # bytes per row
        groups = self.blocks.view(-1, 8 * size)[flat // 8].reshape(-1, size)  # (8 M, bytes per row)
        raw = unpack8(groups.numpy(), self.kind).reshape(-1, 8, size)  # (M, 8, bytes per row)
        return raw[np.arange(flat.shape[0]), (flat % 8).numpy()], base_kind(self.kind)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.lookup(ids)
        return x if self.embed_scale is None else x * self.embed_scale.to(self.dtype)

    def extra_repr(self) -> str:
        name = BLOCK_KINDS.get(base_kind(self.kind), self.kind)
        form = ", 8 rows interleaved" if self.kind in INTERLEAVED.values() else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, GGUF {name} blocks{form}"


def fuse_blocks(layers: Sequence[BlockLinear]) -> tuple[BlockLinear, ...]:
    """Layers computing the outputs of ``layers`` side by side: each run of layers of one type and input
    size fused into one (rows of blocks concatenated, the layers kept as views into them, as
    :func:`~selfextend.models.quantize.fuse_int8`), a run of one kept as it is."""
    runs: list[list[BlockLinear]] = []
    for m in layers:
        if runs and (runs[-1][0].kind, runs[-1][0].in_features) == (m.kind, m.in_features):
            runs[-1].append(m)
        else:
            runs.append([m])
    return tuple(run[0] if len(run) == 1 else _fuse_run(run) for run in runs)


def _fuse_run(layers: list[BlockLinear]) -> BlockLinear:
    blocks = torch.cat([m.blocks for m in layers])
    biases = [m.bias for m in layers]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [torch.zeros(m.out_features) if b is None else b for m, b in zip(layers, biases, strict=True)]
        )
    fused = BlockLinear(blocks, layers[0].kind, layers[0].in_features, bias)
    fused.chunk_engine = layers[0].chunk_engine
    start = 0
    for m in layers:
        rows = slice(start, start + m.out_features)
        m.blocks = blocks[rows]
        if m.bias is not None:
            m.bias = bias[rows]
        start = rows.stop
    return fused


def set_chunk_engine(model: nn.Module, setting: str | None = None, default: str = "auto") -> str:
    """Set every GGUF block layer of ``model`` to multiply prefill chunks by
    :func:`~selfextend.native.quant.chunk_engine` of ``setting`` (``default`` where neither it nor
    ``$SELFEXTEND_PREFILL`` names one); returns the engine. Only int8 keeps each row's result whatever
    rows are beside it, which a server needs for replies that do not change with batching or cache reuse."""
    engine = chunk_engine(setting, default)
    for m in model.modules():
        if isinstance(m, BlockLinear):
            m.chunk_engine = engine
    return engine
