"""A model's run form: the skeleton built on the meta device and filled tensor by tensor, and its file.

Each tensor goes into its run form before the next one is read: per-row int8 plus scales
(:mod:`selfextend.models.quantize`) for linear weights when the form is int8 (in the gguf form, those
handed over as a GGUF's blocks, :class:`GGUFBlocks`, are kept as they are in a
:class:`~selfextend.models.blocks.BlockLinear`; in the int4 form its 4-bit ones are repacked; the other
linear weights are int8); the asked dtype for everything else. The skeleton is built with
accelerate's ``init_empty_weights`` and filled in place, so neither a float32 copy of the whole model
nor a second copy of any kind exists while loading (:mod:`selfextend.models.gguf` feeds it from a
GGUF). A saved run form (one safetensors file of the model's own state) is read back through the
same filling.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from selfextend.models.blocks import F16, BlockEmbedding, BlockLinear, check_blocks
from selfextend.models.heap import release_free_memory
from selfextend.models.quantize import INT4_GROUP, Int4Linear, Int8Linear, quantize_rows
from selfextend.native.blocktypes import INTERLEAVED

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "GGUFBlocks",
    "RowBlocks",
    "RunForm",
    "empty_model",
    "fill",
    "int8_placeholders",
    "release_free_memory",
    "form_bytes",
    "load_run_form",
    "run_form_bytes",
    "save_run_form",
]


@dataclass(frozen=True)
class RunForm:
    """How a model's weights are held while it runs: linear layers as ``weights`` (``float``, ``int8``,
    ``int4``: int4 where the source stores 4-bit blocks, int8 elsewhere; or ``gguf``: a GGUF's blocks as
    stored where the kernels compute their type, int8 elsewhere), and the dtype of the rest."""

    weights: str
    dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        """Whether linear layers are held quantised (int8, int4 or GGUF blocks), not in ``dtype``."""
        return self.weights != "float"

    @property
    def name(self) -> str:
        """``int8-float32``, ``float-bfloat16``...: the cache key's form part."""
        return f"{self.weights}-{str(self.dtype).removeprefix('torch.')}"


def empty_model(config: PretrainedConfig, form: RunForm) -> PreTrainedModel:
    """The model for ``config`` with every weight on the meta device (no memory), linear layers as
    int8 placeholders when ``form.quantized`` (an int4 layer's placeholder is swapped in when its weights
    come). Buffers computed from the config (rotary frequencies) are real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=form.dtype)
    if form.quantized:
        int8_placeholders(model, form.dtype)
    return model


def int8_placeholders(model: nn.Module, dtype: torch.dtype) -> None:
    """Every ``nn.Linear`` of a meta skeleton replaced by an empty (meta) :class:`Int8Linear`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                n, k = child.weight.shape
                bias = None if child.bias is None else torch.empty(n, dtype=dtype, device="meta")
                placeholder = Int8Linear(
                    torch.empty(n, k, dtype=torch.int8, device="meta"), torch.empty(n, device="meta"), bias
                )
                setattr(parent, name, placeholder)


class RowBlocks:
    """A float32 tensor of ``shape`` handed over as ``(first row, block of rows)`` pairs along its first
    axis, so that it never exists whole: :func:`fill` puts each block into the run form as it comes."""

    def __init__(self, shape: tuple[int, ...], blocks: Iterator[tuple[int, torch.Tensor]]) -> None:
        self.shape = shape
        self._blocks = blocks

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        return self._blocks


@dataclass(frozen=True)
class GGUFBlocks:
    """A linear weight as a GGUF stores it in a block format: ``raw`` (N, bytes per row) of type ``kind``,
    rows already in the model's order; :func:`fill` keeps it in a :class:`BlockLinear` (form ``gguf``) or
    repacks its 4-bit blocks into an :class:`Int4Linear` (form ``int4``)."""

    kind: int
    raw: np.ndarray
    columns: int


def _placeholder(model: nn.Module, path: str, kind: type[Int4Linear | BlockLinear]) -> nn.Module:
    """The int8 placeholder at ``path`` swapped for an empty (meta) layer of type ``kind`` and its shape (a
    block layer's type and row bytes come with its buffers), its bias (loaded or not) kept; a layer of
    that type already there is returned as it is."""
    module = model.get_submodule(path)
    if isinstance(module, kind):
        return module
    n, k = module.out_features, module.in_features
    if kind is Int4Linear:
        packed = torch.empty(n, k // 2, dtype=torch.uint8, device="meta")
        layer = Int4Linear(packed, torch.empty(k // INT4_GROUP, n, 2, dtype=torch.bfloat16, device="meta"))
    else:  # an F16 layer of the config's size until its blocks come (its sizes are its buffer's)
        layer = BlockLinear(torch.empty(n, 2 * k, dtype=torch.uint8, device="meta"), F16, k)
    layer.bias = module.bias
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent), child, layer)
    return layer


def _embedding_placeholder(model: nn.Module, path: str, dtype: torch.dtype) -> BlockEmbedding:
    """The (meta) embedding at ``path`` swapped for an empty :class:`BlockEmbedding` of its size, giving rows
    in ``dtype`` (its scale, Gemma's, kept); one already there is returned as it is."""
    module = model.get_submodule(path)
    if isinstance(module, BlockEmbedding):
        return module
    n, dim = module.num_embeddings, module.embedding_dim  # as F16 blocks until the table's come
    empty = torch.empty(n, 2 * dim, dtype=torch.uint8, device="meta")
    table = BlockEmbedding(empty, F16, dim, getattr(module, "embed_scale", None), dtype)
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, table)
    return table


def _materialise(value: torch.Tensor | RowBlocks, dtype: torch.dtype | None) -> torch.Tensor:
    """``value`` as one tensor, floating values cast to ``dtype`` (None: kept as they are)."""
    if isinstance(value, torch.Tensor):
        return value if dtype is None or not value.is_floating_point() else value.to(dtype)
    out = torch.empty(value.shape, dtype=dtype or torch.float32)
    for a, rows in value:
        out[a : a + rows.shape[0]] = rows  # the same rounding as .to(dtype)
    return out


def _quantize(value: torch.Tensor | RowBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~selfextend.models.quantize.quantize_rows` of a weight, block by block for :class:`RowBlocks`
    (rows are quantised independently, so the result is the same)."""
    if isinstance(value, torch.Tensor):
        return quantize_rows(value)
    q = torch.empty(value.shape, dtype=torch.int8)
    scale = torch.empty(value.shape[0], dtype=torch.float32)
    for a, rows in value:
        q[a : a + rows.shape[0]], scale[a : a + rows.shape[0]] = quantize_rows(rows)
    return q, scale


def _assign(
    model: nn.Module, name: str, tensor: torch.Tensor | RowBlocks | GGUFBlocks, form: RunForm
) -> None:
    """Put one checkpoint tensor into ``model`` in its run form (a float weight of an int8 layer is
    quantised here; GGUF blocks go into a block layer as they are (form ``gguf``) or are repacked into an
    int4 layer, either replacing the int8 placeholder; an int8, int4 or block layer's own buffers go in as
    they are)."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    dtype = form.dtype
    if isinstance(module, nn.Embedding | BlockEmbedding) and (
        isinstance(tensor, GGUFBlocks) or attr in ("blocks", "block_kind")
    ):  # an embedding table held as blocks (as read from the GGUF, or a saved one's buffers)
        table = _embedding_placeholder(model, path, dtype)
        if isinstance(tensor, GGUFBlocks):
            table.blocks = torch.from_numpy(tensor.raw)
            table.set_kind(tensor.kind)
        elif attr == "blocks":
            table.blocks = _materialise(tensor, None)
        else:
            table.set_kind(int(_materialise(tensor, None)[0]))
    elif isinstance(tensor, GGUFBlocks) and form.weights == "gguf":
        layer = _placeholder(model, path, BlockLinear)
        layer.blocks = torch.from_numpy(tensor.raw)
        layer.set_kind(tensor.kind)
        layer.interleave()
    elif attr == "blocks" or attr == "block_kind":  # a saved block layer
        layer = _placeholder(model, path, BlockLinear)
        if attr == "blocks":
            layer.blocks = _materialise(tensor, None)
        else:
            layer.set_kind(int(_materialise(tensor, None)[0]))
    elif isinstance(tensor, GGUFBlocks):
        layer = _placeholder(model, path, Int4Linear)
        built = Int4Linear.from_gguf(tensor.kind, tensor.raw, tensor.columns)
        layer.weight_int4, layer.scales_zeros = built.weight_int4, built.scales_zeros
    elif attr in ("weight_int4", "scales_zeros"):  # a saved int4 layer
        _placeholder(model, path, Int4Linear)._buffers[attr] = _materialise(tensor, None)
    elif isinstance(module, Int8Linear) and attr == "weight":
        q, scale = _quantize(tensor)
        module.weight_int8, module.scale = q, scale.to(torch.bfloat16)
    elif attr in module._parameters:
        _same_shape(name, module._parameters[attr], tensor)
        module._parameters[attr] = nn.Parameter(_materialise(tensor, dtype), requires_grad=False)
    elif attr in module._buffers:
        _same_shape(name, module._buffers[attr], tensor)
        keep = isinstance(module, Int8Linear) and attr in ("weight_int8", "scale")
        module._buffers[attr] = _materialise(tensor, None if keep else dtype)
    else:
        raise KeyError(f"checkpoint tensor {name} has no place in {type(model).__name__}")


def _same_shape(name: str, held: torch.Tensor | None, tensor: torch.Tensor | RowBlocks) -> None:
    """ValueError naming ``name`` where a tensor's shape is not that of the skeleton's place for it."""
    if held is not None and tuple(held.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} where the config says {tuple(held.shape)}")


def _size(m: nn.Module) -> tuple[int, int] | None:
    """(rows, columns) a linear layer or embedding table holds, read from its weight's own buffer."""
    if isinstance(m, BlockLinear):
        return m.out_features, m.in_features
    if isinstance(m, BlockEmbedding):
        return m.num_embeddings, m.embedding_dim
    if isinstance(m, Int4Linear):
        return m.weight_int4.shape[0], 2 * m.weight_int4.shape[1]
    w = m.weight_int8 if isinstance(m, Int8Linear) else getattr(m, "weight", None)
    return tuple(w.shape) if isinstance(m, nn.Linear | nn.Embedding | Int8Linear) else None


def _check_sizes(model: nn.Module, sizes: dict[str, tuple[int, int] | None]) -> None:
    """ValueError naming the layer where a filled layer's sizes (its buffers') are not those the config gave
    the skeleton (``sizes``), or a block layer's buffer is not whole blocks of its type."""
    for path, m in model.named_modules():
        if isinstance(m, BlockLinear | BlockEmbedding):
            check_blocks(m.blocks, m.kind, path)
        got, want = _size(m), sizes.get(path)
        if want is not None and got is not None and got != want:
            raise ValueError(f"{path}: {got[0]} rows of {got[1]} where the config says {want}")


def _tie_head(model: nn.Module) -> None:
    """A tied output head shares the embedding (float) or is quantised from it (int8, if still empty;
    an int4 head was filled from its own blocks); a block head saved without its bytes (they were the
    block table's) takes the table's; a block table looks its rows up in the head's bytes, as stored or
    interleaved (:class:`BlockEmbedding`), its own copy dropped: the table is held once."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if tied and isinstance(head, BlockLinear) and isinstance(embed, BlockEmbedding):
        same = head.kind in (embed.kind, INTERLEAVED.get(embed.kind))
        if head.blocks.is_meta:
            head.blocks = embed.blocks  # saved once: the head read the table's bytes as they are
        elif same and head.blocks.shape[0] == embed.num_embeddings:
            embed.blocks = head.blocks  # the same rows, as stored or rearranged when the head took them
            embed.set_kind(head.kind)
        return
    if not tied or head is None or isinstance(head, Int4Linear | BlockLinear):
        return
    if not isinstance(head, Int8Linear):
        head.weight = embed.weight
    elif head.weight_int8.is_meta and not embed.weight.is_meta:
        q, scale = quantize_rows(embed.weight)
        head.weight_int8, head.scale = q, scale.to(torch.bfloat16)


def fill(
    model: PreTrainedModel,
    tensors: Iterable[tuple[str, torch.Tensor | RowBlocks | GGUFBlocks]],
    form: RunForm,
) -> PreTrainedModel:
    """Fill a model from :func:`empty_model` with ``(name, tensor)`` pairs, each turned into its run form
    as it arrives; a tied output head is then tied (float) or quantised from the embedding (int8).

    Raises ``KeyError`` if a tensor has no place in the model or a weight is still missing afterwards.
    """
    sizes = {path: _size(m) for path, m in model.named_modules()}
    for name, tensor in tensors:
        _assign(model, name, tensor, form)
        del tensor
        release_free_memory()
    _tie_head(model)
    release_free_memory()
    _check_sizes(model, sizes)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise KeyError(f"{len(missing)} weights missing from the checkpoint, e.g. {', '.join(missing[:3])}")
    model.eval()
    return model


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent weights, each storage once (a tied head is re-tied when loaded)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.contiguous()
    return out


def save_run_form(model: nn.Module, path: str | Path, form: RunForm) -> None:
    """Write the model's weights, as they are held, into one safetensors file."""
    from safetensors.torch import save_file

    save_file(_state(model), str(path), metadata={"form": form.name})


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_safetensors(path: Path) -> tuple[dict[str, str], Iterator[tuple[str, torch.Tensor]]]:
    """The metadata and the tensors of a safetensors file, each read into its own fresh buffer.

    Why not ``safetensors.safe_open``: it maps the file and hands out tensors inside the mapping, at
    offsets with no alignment (torch's int8 matrix kernel crashes on them), and copying them out
    keeps the mapped pages resident next to the copies, twice the weights at the peak. The format is
    an 8-byte header length, a JSON header (dtype, shape, byte range per tensor) and the raw bytes.
    """
    f = path.open("rb")
    size = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(size))
    metadata = header.pop("__metadata__", {}) or {}
    start = 8 + size

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        with f:
            for name, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                begin, end = spec["data_offsets"]
                buf = torch.empty(end - begin, dtype=torch.uint8)
                f.seek(start + begin)
                if f.readinto(memoryview(buf.numpy())) != end - begin:
                    raise OSError(f"{path} is truncated")
                yield name, buf.view(_SAFETENSORS_DTYPES[spec["dtype"]]).reshape(spec["shape"])

    return metadata, tensors()


def load_run_form(path: str | Path, config: PretrainedConfig, form: RunForm) -> PreTrainedModel:
    """Read back what :func:`save_run_form` wrote: the skeleton filled tensor by tensor, nothing converted."""
    metadata, tensors = _read_safetensors(Path(path))
    if metadata.get("form") != form.name:
        tensors.close()
        raise KeyError(f"{path} holds weights in form {metadata.get('form')}, not {form.name}")
    return fill(empty_model(config, form), tensors, form)


def run_form_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def form_bytes(config: PretrainedConfig, form: RunForm) -> int:
    """Bytes the weights of ``config``'s model take in ``form``, counted on a meta skeleton (nothing loaded).

    Linear weights: 1 byte per value + a bfloat16 scale per row in int8; the rest in ``form.dtype``.
    A tied output head counts once in float and as its own int8 copy in int8, as loading makes it.
    """
    with torch.device("meta"):  # (init_empty_weights makes each parameter, then moves it: a config's huge
        model = empty_model(config, form)  # table would be allocated first, and refused)
    _tie_head(model)
    total = 0
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total
