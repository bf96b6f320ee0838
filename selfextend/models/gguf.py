"""Reading a GGUF's tensors into a model's run form, one tensor at a time, a block of rows at a time.

The ``gguf`` package parses the tensor table and dequantises blocks (``gguf.dequantize``), and
transformers' GGUF tables name each tensor (``get_gguf_hf_weights_map`` and the per-architecture
``TENSOR_PROCESSORS``, which undo llama.cpp's q/k permutation and Gemma's "+1" norms), so no block
format or name table is re-implemented here. The reader's parsed metadata is dropped once the tensor
table is copied out, before any weight is read; a tensor's bytes are read from the file a block of
rows at a time (not through the reader's memory map, whose touched pages would stay resident), and a
tensor the architecture's processor leaves as it is goes into its run form block by block.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig, PreTrainedModel

from selfextend.hf.facts import ModelError
from selfextend.models.blocks import block_packable
from selfextend.models.gguf_check import check_magic, check_table
from selfextend.models.gguf_config import gguf_config
from selfextend.models.gguf_families import check_present, read_by, tensor_names
from selfextend.models.gguf_rope import GGUFRope
from selfextend.models.quantize import int4_packable
from selfextend.models.weights import GGUFBlocks, RowBlocks, RunForm, empty_model, fill, int8_placeholders

KEPT_BLOCKS = {
    "int4": int4_packable,
    "gguf": block_packable,
}  # by form: which stored weights keep their blocks
log = logging.getLogger(__name__)

_BLOCK_BYTES = 4 << 20  # float32 bytes of one block of rows read from a GGUF


@dataclass(frozen=True)
class _Stored:
    """One tensor of a GGUF's table: its name, type, where its bytes are and how they are laid out."""

    name: str
    kind: int  # gguf.GGMLQuantizationType
    raw_shape: tuple[int, ...]  # of the stored data, rows first (block formats: bytes per row last)
    raw_dtype: np.dtype
    offset: int  # in the file

    def value_shape(self) -> tuple[int, ...] | None:
        """The shape of a stored vector or matrix as its values (None for a 3-axis tensor)."""
        if len(self.raw_shape) > 2:
            return None
        return (*self.raw_shape[:-1], _value_shape(self)[-1])

    def read(self, f: BinaryIO, a: int, b: int) -> np.ndarray:
        """Rows ``a:b`` of the stored data, read into a fresh array (a 1-D tensor: all of it)."""
        rows = self.raw_shape[1:] if len(self.raw_shape) > 1 else ()
        shape = (b - a, *rows) if rows else self.raw_shape
        buf = np.empty(shape, dtype=self.raw_dtype)
        f.seek(self.offset + a * math.prod(rows) * self.raw_dtype.itemsize)
        if f.readinto(memoryview(buf.reshape(-1).view(np.uint8))) != buf.nbytes:
            raise OSError(f"tensor {self.name} ends past the end of the file")
        return buf


@dataclass(frozen=True)
class GGUFTable:
    """What :func:`gguf_tensors` needs of a GGUF's metadata: its architecture and tensor table.

    Made from a ``gguf.GGUFReader`` (:meth:`of`), which can then be dropped: its parsed metadata is,
    for a large vocabulary, hundreds of MB of Python objects (Gemma 3's 262k entries: 0.65 GB).
    """

    architecture: str
    tensors: tuple[_Stored, ...]
    rope: GGUFRope = field(default_factory=GGUFRope)  # its rotation and head sizes (models/gguf_rope.py)

    @classmethod
    def of(cls, reader: GGUFReader) -> GGUFTable:
        """The table of an open reader."""
        from transformers.modeling_gguf_pytorch_utils import read_field

        tensors = tuple(
            _Stored(t.name, t.tensor_type, tuple(t.data.shape), t.data.dtype, t.data_offset)
            for t in reader.tensors
        )
        architecture = read_field(reader, "general.architecture")[0]
        return cls(architecture, tensors, GGUFRope.of(reader, architecture))

    @classmethod
    def read(cls, path: str | Path) -> GGUFTable:
        """The table of the GGUF at ``path`` (parsing its metadata: seconds for a large vocabulary)."""
        from selfextend.models.gguf_reader import GGUFFileReader

        return cls.of(GGUFFileReader(str(path)))


def check_gguf(path: str | os.PathLike[str]) -> GGUFTable:
    """Refuse a file that is not a complete GGUF (:class:`ModelError` naming the file and the fault);
    return its tensor table, so a conversion need not parse the file again (:func:`checked_reader`)."""
    return GGUFTable.of(checked_reader(path))


def read_gguf(path: Path) -> tuple[GGUFTable, PretrainedConfig]:
    """A GGUF's tensor table and config, its metadata parsed once (:func:`checked_reader`, then
    transformers reads the config through the same reader); the reader is dropped on return."""
    return table_and_config(path, checked_reader(path))


def table_and_config(path: Path, reader: GGUFReader) -> tuple[GGUFTable, PretrainedConfig]:
    """:func:`read_gguf` through an open :func:`checked_reader` of ``path`` (kept by a caller that hands
    it on to the tokenizer's conversion, :func:`~selfextend.models.gguf_config.parsed_by`), whose walk
    refused a file without its architecture or trained window."""
    table = GGUFTable.of(reader)
    return table, gguf_config(path, table.rope, reader)


def checked_reader(path: str | os.PathLike[str]) -> GGUFReader:
    """The ``gguf`` package's reader of ``path``, refusing a file that is not a complete GGUF
    (:class:`ModelError` naming the file and the fault).

    The ``gguf`` package's reader parses the header, the metadata and the tensor table and maps every
    tensor's data, so a truncated or corrupted file fails here, before transformers half-reads it. It
    costs seconds (it parses the vocabulary), so it runs only before a conversion or a metadata read.
    """
    p = Path(path)
    check_magic(p)
    check_table(p)  # counts, sizes and the vocabulary, before the reader builds anything on them
    from selfextend.models.gguf_reader import GGUFFileReader

    try:
        reader = GGUFFileReader(p)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors... on bad bytes
        raise ModelError(
            f"{p} is truncated or corrupted: its GGUF header, metadata or tensor table cannot be read "
            f"({type(exc).__name__})"
        ) from exc
    size = p.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelError(f"{p} is truncated: tensor {t.name} ends past the end of the file")
    if not reader.tensors:
        raise ModelError(f"{p} is a GGUF file without tensors (no weights)")
    return reader


def gguf_tensors(
    path: str | Path,
    model: nn.Module,
    table: GGUFTable | None = None,
    keep: Callable[[int, int, int], bool] | None = None,
    embedding_blocks: bool = False,
) -> Iterator[tuple[str, torch.Tensor | RowBlocks | GGUFBlocks]]:
    """The tensors of a GGUF as ``(transformers name, float32 tensor, RowBlocks or GGUFBlocks)``, one by one.

    ``model`` is the (meta) skeleton with plain ``nn.Linear`` layers, whose state names give the map
    (made at once, so the skeleton may be changed before the tensors are read); ``table`` is the
    GGUF's :class:`GGUFTable` if it was read already (else it is read here). A tensor bigger than
    one block of rows (4 MB in float32) has its first block put through the architecture's
    processor; if the processor hands back the very array it got (it leaves that tensor as it is:
    every processor in transformers changes a tensor by making a new array), the tensor comes as
    :class:`RowBlocks`, each block dequantised when it is consumed. Otherwise it is dequantised whole
    (block by block into one float32 array, so the dequantiser's temporaries stay small) and
    processed whole, as transformers does. Each yielded item must be consumed before the next is
    asked for. Tensors the model has no place for (e.g. llama.cpp's precomputed ``rope_freqs``) are
    skipped unread (:func:`~selfextend.models.gguf_families.read_by`).

    With ``keep``, a linear layer's weight for which ``keep(type, rows, columns)`` holds (a block format
    the run form takes as stored, :data:`KEPT_BLOCKS`) comes as :class:`GGUFBlocks`, its stored bytes as
    they are, when the processor does nothing to it but reorder its rows (llama.cpp
    permutes the q and k rows of Llama-family models; transformers' processor undoes it): the rows of a
    block format are independent, so the stored rows are put in the processor's order (found by passing
    it the row numbers). Anything else the processor does to a tensor sends it down the float path.
    With ``embedding_blocks`` the embedding table comes as :class:`GGUFBlocks` on the same terms (a tied
    output head's very bytes: both are yielded, the head first).
    """
    from gguf import dequantize

    table = table or GGUFTable.read(path)
    processor, mapping = tensor_names(model, table.architecture)
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    parsed: dict[str, dict] = {"config": model.config.to_dict(), "tensors": {}}
    module_names = {id(m): n for n, m in model.named_modules()}
    embedding = f"{module_names[id(model.get_input_embeddings())]}.weight"
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    out_head = model.get_output_embeddings() if tied else None
    head = None if out_head is None else f"{module_names[id(out_head)]}.weight"
    held = linear | {embedding} if embedding_blocks else linear  # the weights that may keep their blocks
    shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    check_present({t.name for t in table.tensors}, mapping, model)

    def checked(gguf_name: str, name: str, value: torch.Tensor | RowBlocks | GGUFBlocks) -> tuple[str, ...]:
        """``(name, value)``, or ModelError naming the GGUF tensor where its shape is not the config's."""
        got = (value.raw.shape[0], value.columns) if isinstance(value, GGUFBlocks) else tuple(value.shape)
        want = shapes.get(name)
        if want is not None and got != want:
            raise ModelError(f"{gguf_name}: shape {got} where the config says {want}")
        return name, value

    def process(weights: np.ndarray, name: str) -> tuple[np.ndarray, str]:
        result = processor.process(
            weights=weights, name=name, tensor_key_mapping=mapping, parsed_parameters=parsed
        )
        return result.weights, result.name

    def row_order(t: _Stored) -> tuple[np.ndarray | None, str] | None:
        """The processor's row order for ``t`` (None: as stored) and its name, or None when the processor
        does more than reorder rows."""
        index = np.arange(t.raw_shape[0], dtype=np.float32)[:, None]  # (N, 1): row numbers, exact in float32
        try:
            out, name = process(index, t.name)
        except (ValueError, IndexError):
            return None
        if out is index:
            return None, name
        out = np.asarray(out)
        if out.shape != index.shape or not np.array_equal(np.sort(out[:, 0]), index[:, 0]):
            return None
        return out[:, 0].astype(np.int64), name

    def as_blocks(f: BinaryIO, t: _Stored, target: str | None = None) -> tuple[str, GGUFBlocks] | None:
        """``t`` as :class:`GGUFBlocks` under its model name (or ``target``, a linear layer's weight it
        fills too), or None when it goes the float way."""
        columns = _value_shape(t)[-1]
        if keep is None or len(t.raw_shape) != 2 or not keep(t.kind, t.raw_shape[0], columns):
            return None
        found = row_order(t)
        if found is None or (target or mapping.get(found[1])) not in held:
            return None
        order, name = found
        raw = t.read(f, 0, t.raw_shape[0]).view(np.uint8)  # (N, bytes per row): no float copy (F16: bytes)
        return target or mapping[name], GGUFBlocks(t.kind, raw if order is None else raw[order], columns)

    def tied_head(f: BinaryIO, t: _Stored) -> tuple[str, GGUFBlocks] | None:
        """A tied output head's own :class:`GGUFBlocks` when ``t`` is the embedding it shares: the head
        then reads the file's bytes (a Q6_K embedding: 0.82 bytes a weight, not int8's 1.0 in a slower
        product), while the embedding itself goes the float way (a lookup reads one row a token)."""
        if head is None or mapping.get(t.name) != embedding:
            return None
        found = as_blocks(f, t, head)
        return None if found is None else (head, found[1])

    def blocks(f: BinaryIO, t: _Stored, step: int, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        for a in range(start, t.raw_shape[0], step):
            yield a, dequantize(t.read(f, a, min(a + step, t.raw_shape[0])), t.kind)

    def stream() -> Iterator[tuple[str, torch.Tensor | RowBlocks | GGUFBlocks]]:
        with open(path, "rb") as f:
            for t in table.tensors:
                # a tensor with no place in the model (RoPE tensors: gguf_rope reads them from the table)
                if not read_by(t.name, mapping):
                    continue
                shared = tied_head(f, t)
                if shared is not None:
                    yield checked(t.name, *shared)
                    if embedding_blocks:  # the table looks its rows up in the head's bytes
                        yield checked(t.name, embedding, shared[1])
                        continue
                packed = as_blocks(f, t)
                if packed is not None:
                    yield checked(t.name, *packed)
                    continue
                rows = t.raw_shape[0]
                # a 1-D tensor is read whole (a block format's bytes cannot be cut between values), and
                # so is a stack of experts (the processor fuses the gate and up stacks whole)
                step = rows if len(t.raw_shape) != 2 else max(1, _BLOCK_BYTES // (4 * _value_shape(t)[0]))
                if step >= rows:  # one block: the whole tensor
                    array, name = process(dequantize(t.read(f, 0, rows), t.kind), t.name)
                else:
                    _, first = next(blocks(f, t, step))
                    try:
                        probe, name = process(first, t.name)
                    except (ValueError, IndexError):  # a reshape that needs the whole tensor
                        probe, name = None, t.name
                    if probe is first:
                        if name in mapping:
                            shape = (rows, *first.shape[1:])
                            pairs = [(0, first)], blocks(f, t, step, step)
                            yield checked(t.name, mapping[name], RowBlocks(shape, _to_torch(*pairs)))
                        continue
                    del first, probe
                    whole = np.empty((rows, *_value_shape(t)), dtype=np.float32)
                    for a, x in blocks(f, t, step):
                        whole[a : a + x.shape[0]] = x
                    array, name = process(whole, t.name)
                    del whole
                if name in mapping:
                    value = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
                    yield checked(t.name, mapping[name], value)
        for name, value in parsed["tensors"].items():  # what the processor assembled from several (experts)
            yield checked(name, name, value)

    return stream()


def _to_torch(*parts: Iterable[tuple[int, np.ndarray]]) -> Iterator[tuple[int, torch.Tensor]]:
    for part in parts:
        for a, x in part:
            yield a, torch.from_numpy(x)


def _value_shape(t: _Stored) -> tuple[int, ...]:
    """The dequantised shape of one row of a tensor of two or more axes (block formats store bytes last)."""
    from gguf import GGML_QUANT_SIZES

    block_values, block_bytes = GGML_QUANT_SIZES[t.kind]
    last = t.raw_shape[-1] * t.raw_dtype.itemsize // block_bytes * block_values
    return (*t.raw_shape[1:-1], last)


@dataclass
class Held:
    """The matrices of one GGUF type that a run form holds one way (as stored, or not): how many, their
    weights, their bytes in the file and in memory, and whether the embedding table is among them."""

    kind: int
    stored_as_is: bool
    matrices: int = 0
    weights: int = 0
    file_bytes: int = 0
    held_bytes: int = 0
    embedding: bool = False


def held_matrices(table: GGUFTable, keep: Callable[[int, int, int], bool], dtype: torch.dtype) -> list[Held]:
    """What a run form holds of a GGUF's matrices (F32 ones aside), by type and way: those ``keep`` takes
    hold their stored bytes, the others int8 with a float32 scale a row (the embedding table: ``dtype``).
    A tied output head shares the embedding's bytes (interleaved or not: the table then reads its rows from
    the head's form), so the table counts once."""
    from gguf import GGMLQuantizationType

    held: dict[tuple[int, bool], Held] = {}
    for t in table.tensors:
        if len(t.raw_shape) != 2 or t.kind == GGMLQuantizationType.F32:
            continue
        rows, columns = t.raw_shape[0], _value_shape(t)[-1]
        kept, stored = keep(t.kind, rows, columns), math.prod(t.raw_shape) * t.raw_dtype.itemsize
        entry = held.setdefault((t.kind, kept), Held(t.kind, kept))
        table_held = t.name == "token_embd.weight"
        entry.matrices += 1
        entry.weights += rows * columns
        entry.file_bytes += stored
        entry.embedding |= table_held
        if kept:
            entry.held_bytes += stored
        else:
            size = torch.finfo(dtype).bits // 8 if table_held else 1
            entry.held_bytes += rows * columns * size + (4 * rows if size == 1 else 0)
    return sorted(held.values(), key=lambda h: (h.kind, not h.stored_as_is))


def fallbacks(table: GGUFTable, keep: Callable[[int, int, int], bool], dtype: torch.dtype) -> list[str]:
    """One line per GGUF type of the matrices a run form does not hold as stored (``keep``: IQ2_XXS, TQ1_0,
    a K-quant whose rows are no whole super-blocks...): what they become, int8 with a float32 scale a row
    (the embedding table: ``dtype``), and the bytes that takes against the file's."""
    from gguf import GGMLQuantizationType

    table_as = f" (the embedding table as {str(dtype).removeprefix('torch.')})"
    return [
        f"{h.matrices} {GGMLQuantizationType(h.kind).name} matrices ({h.file_bytes / 1e6:.1f} MB, "
        f"{8 * h.file_bytes / h.weights:.2f} bits a weight) are held as int8"
        f"{table_as if h.embedding else ''}: "
        f"{h.held_bytes / 1e6:.1f} MB, {8 * h.held_bytes / h.weights:.2f} bits a weight"
        for h in held_matrices(table, keep, dtype)
        if not h.stored_as_is
    ]


def load_gguf(
    path: str | Path, config: PretrainedConfig, form: RunForm, table: GGUFTable | None = None
) -> PreTrainedModel:
    """A GGUF's model in ``form``, tensor by tensor (see the module docstring); ``table`` as in
    :func:`gguf_tensors`."""
    model = empty_model(config, RunForm("float", form.dtype))
    keep, gguf = KEPT_BLOCKS.get(form.weights), form.weights == "gguf"  # gguf: the embedding's blocks too
    table = table or GGUFTable.read(path)
    if keep is not None:
        for line in fallbacks(table, keep, form.dtype):
            log.warning(line)
    tensors = gguf_tensors(path, model, table, keep, gguf)  # the map needs plain linears
    if form.quantized:
        int8_placeholders(model, form.dtype)
    return fill(model, tensors, form)
