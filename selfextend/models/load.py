"""Loading a model and its tokenizer inference-ready: from a converted GGUF, a directory or the hub."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from selfextend.core.validate import first_line
from selfextend.hf.facts import ModelError, check_rope
from selfextend.models.diskcache import (
    RUN_FORM_FILE,
    convert_into,
    gguf_cache_dir,
    gguf_of,
    is_complete,
    parse_dtype,
    run_form,
)
from selfextend.models.gguf import GGUFTable, read_gguf
from selfextend.models.gguf_check import check_magic
from selfextend.models.quantize import Int8Linear, quantize_int8
from selfextend.models.sources import DEFAULT_MODEL, ModelSource, hub_load, resolve_model
from selfextend.models.weights import (
    RunForm,
    load_run_form,
)
from selfextend.native.quant import quant_kernels

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def _parse_device(device: str | torch.device) -> torch.device:
    """Parse a device and check it is there, before anything slow (a GGUF conversion) starts."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelError(f"unknown device '{device}': use cpu, cuda, cuda:N or mps") from exc
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device '{device}' asked for, but this torch sees no CUDA GPU")
    if target.type == "mps" and not torch.backends.mps.is_available():
        raise ModelError(f"device '{device}' asked for, but MPS is not available here")
    return target


def default_dtype(device: str | torch.device, device_map: object = None) -> torch.dtype:
    """The dtype a model runs in where none is asked for: float32 on the CPU (exact, and its native kernels'
    type); bfloat16 on a GPU (an 8B model's weights in 16 GB, read at the memory's rate; the fused kernels'
    type), float16 on one without bfloat16 matrix units (compute capability below 8.0). A device map
    counts as a GPU where CUDA is there."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):  # an unknown device: _parse_device says so
        return torch.float32
    if target.type != "cuda" and (device_map is None or not torch.cuda.is_available()):
        return torch.float32
    if torch.cuda.is_available():
        gpu = target if target.type == "cuda" else None
        if torch.cuda.get_device_capability(gpu)[0] < 8:
            return torch.float16
    return torch.bfloat16


def checkpoint_dtype(name_or_path: str) -> torch.dtype:
    """What ``dtype="auto"`` loads a model in: float32 for a GGUF (its converted form), else the dtype its
    config names (float32 where it names none), so that a sweep asked for ``auto`` knows which records are
    its own before it loads anything."""
    if resolve_model(name_or_path).kind == "gguf":
        return torch.float32
    config = load_config(name_or_path)
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    parsed = parse_dtype(named) if named is not None else torch.float32
    return parsed if isinstance(parsed, torch.dtype) else torch.float32


def load_config(name_or_path: str = DEFAULT_MODEL) -> PretrainedConfig:
    """Read a model's config without loading weights (for ``info``), and check that it uses RoPE.

    A GGUF's config comes from the GGUF's metadata (no dequantising).
    """
    return read_config(name_or_path)[0]


def read_config(name_or_path: str = DEFAULT_MODEL) -> tuple[PretrainedConfig, GGUFTable | None]:
    """:func:`load_config`'s config, and for a GGUF its tensor table (its metadata parsed once for both)."""
    from transformers import AutoConfig

    source = resolve_model(name_or_path)
    table = None
    if source.kind == "gguf":
        table, config = read_gguf(source.gguf_path)
    else:
        config = hub_load(source, AutoConfig.from_pretrained)
    check_rope(config, source.name)
    return config, table


def _load_gguf_model(source: ModelSource, form: RunForm) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A GGUF in its run form: from the cache, or converted into it first (and then used as converted,
    not read back). The tokenizer is loaded before the weights, so its transient peak (large for a
    big vocabulary) does not add to theirs."""
    from transformers import AutoConfig, AutoTokenizer

    entry = gguf_cache_dir(source, form)
    if not is_complete(entry):
        return convert_into(entry, gguf_of(source), form)
    cached = ModelSource("dir", str(entry), source.name)
    tokenizer = hub_load(cached, AutoTokenizer.from_pretrained)
    config = hub_load(cached, AutoConfig.from_pretrained)
    check_rope(config, source.name)
    try:
        model = load_run_form(entry / RUN_FORM_FILE, config, form)
    except (OSError, KeyError, RuntimeError) as exc:
        raise ModelError(
            f"cannot read the model cache {entry} (try: selfextend cache clear): {first_line(exc)}"
        ) from exc
    return model, tokenizer


def _place(model: PreTrainedModel, device_map: str | dict[str, Any]) -> None:
    """Spread a model read whole into CPU memory (a GGUF's cached run form) over the devices, with
    accelerate's hooks moving activations between them; a named map is inferred as accelerate does."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if isinstance(device_map, str):
        no_split = list(getattr(model, "_no_split_modules", None) or [])
        memory = (
            None
            if device_map == "sequential"
            else get_balanced_memory(model, no_split_module_classes=no_split)
        )
        device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split)
    if "disk" in device_map.values():
        raise ModelError("the model does not fit in GPU and CPU memory together")
    dispatch_model(model, device_map)


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's names for a placement


def auto_weights(weights: str, source: ModelSource, device: torch.device, placed: bool = False) -> str:
    """``weights`` itself, or for ``"auto"``: ``float`` where accelerate places the layers (``placed``: a
    device map; it places float layers only) or on a GPU (a GGUF dequantized to ``--dtype`` at load:
    the int8/int4/block products are CPU kernels, and the GPU's own matrix units read bf16 at the memory's
    rate); on the CPU, for a GGUF its blocks as stored (``gguf``: native int8 dot products, the fastest form
    there and within 0.3% of float perplexity), or ``int4`` (its 4-bit blocks repacked for torch's kernel)
    where the native products cannot be built; int8 otherwise."""
    if weights != "auto":
        return weights
    if placed or device.type != "cpu":
        return "float"
    if source.kind != "gguf":
        return "int8"
    return "gguf" if quant_kernels() is not None else "int4"


def attention_for(config: PretrainedConfig, wanted: str) -> str:
    """``wanted``, or ``eager`` (said in one line) where the model's class has no SDPA path: Gemma 2,
    whose attention soft-capping SDPA cannot compute."""
    from transformers import AutoModelForCausalLM

    if wanted != "sdpa":
        return wanted
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return wanted
    if getattr(model_class, "_supports_sdpa", True):
        return wanted
    log.info("%s: attention computed eagerly (its transformers class has no SDPA path)", config.model_type)
    return "eager"


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    weights: str = "float",
    device_map: str | dict[str, Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, on ``device``, inference-ready: eval mode, gradients off.

    ``dtype`` None is :func:`default_dtype`'s for the device: float32 on the CPU, bfloat16 on a GPU.

    ``device_map`` (``"auto"``, ``"balanced"``, ... or an explicit map) places the layers with
    accelerate's big-model loading instead of moving the whole model to ``device``.

    With ``requires_grad`` off on every parameter a forward builds no autograd graph even outside
    ``torch.no_grad()`` (a 2k-token forward otherwise keeps gigabytes of activations alive).

    ``weights="int8"`` holds every linear layer as per-row int8
    (:mod:`selfextend.models.quantize`), the rest in
    ``dtype``. A GGUF goes tensor by tensor into that form once and is cached in it (see
    :func:`ensure_converted`; ``"auto"`` means float32). A model directory or hub id loads in ``dtype``;
    with int8 it loads in its checkpoint's own dtype, each linear layer is quantised in place (its float
    weight freed as it goes) and only the rest is cast to ``dtype``, so a bfloat16 checkpoint never
    exists in float32.

    ``weights="auto"`` is gguf (int4 without a C compiler) for a GGUF on the CPU, int8 for other sources on
    the CPU, and float on a GPU or with a device map (:func:`auto_weights`).

    ``weights="gguf"`` holds a GGUF's linear weights in the block formats the native products compute
    (:data:`~selfextend.native.blocktypes.BLOCK_TYPES`) as stored, in a
    :class:`~selfextend.models.blocks.BlockLinear` (a tied output head reads the embedding's own blocks,
    interleaved where the kernels hold its type so, the table then looking its rows up in that form),
    and every other linear layer as int8.

    ``weights="int4"`` holds a GGUF's linear weights stored in 4-bit blocks (Q4_0, Q4_1, Q4_K) as
    :class:`~selfextend.models.quantize.Int4Linear`, repacked from the blocks themselves (no value is
    rounded again and no float copy is made), and every other linear layer as int8. A source without
    4-bit blocks (a model directory, a hub id) loads as int8, saying so in one logged warning: 4-bit
    weights made by rounding float ones would be another model than the one the user picked.
    Raises :class:`ModelError` for non-RoPE models and anything that cannot be read.
    """
    from transformers import AutoConfig, AutoTokenizer

    source = resolve_model(name_or_path)
    target = _parse_device(device)
    if dtype is None:
        dtype = default_dtype(target, device_map)
    if source.gguf_path is not None:  # a file that is no GGUF, before "auto" builds the block kernels for it
        check_magic(source.gguf_path)
    form = run_form(auto_weights(weights, source, target, device_map is not None), dtype)
    if form.weights in ("int4", "gguf") and target.type != "cpu":
        raise ModelError(f"--weights {form.weights} runs on the CPU only (its kernels), not on {target}")
    if target.type == "meta":  # weights without data: it loaded, and failed at the first value read
        raise ModelError(f"device '{device}' holds no data: a model runs on cpu or cuda")
    if isinstance(device_map, str) and device_map not in DEVICE_MAPS:  # accelerate took any name as auto
        raise ModelError(f"unknown device map '{device_map}': use {', '.join(DEVICE_MAPS)} or a dict")
    if device_map is not None and form.quantized:
        raise ModelError(
            f"a device map needs float weights: {form.weights} layers are not placed by accelerate"
        )
    if source.kind == "gguf":
        model, tokenizer = _load_gguf_model(source, form)
    else:
        config = hub_load(source, AutoConfig.from_pretrained)
        check_rope(config, source.name)
        wanted = parse_dtype(dtype)
        kwargs: dict[str, Any] = {"dtype": "auto" if form.quantized else wanted}
        if attn_implementation:
            kwargs["attn_implementation"] = attention_for(config, attn_implementation)
        if device_map is not None:
            kwargs["device_map"] = device_map
        model = _checked_load(source, kwargs)
        tokenizer = hub_load(source, AutoTokenizer.from_pretrained)
        if form.weights in ("int4", "gguf"):
            log.warning(
                "--weights %s keeps a GGUF's blocks; %s has none: int8 weights", form.weights, source.name
            )
        if form.quantized:
            quantize_int8(model)
            if wanted != "auto":
                _cast_float_weights(model, wanted)
    if attn_implementation and source.kind == "gguf":
        model.set_attn_implementation(attention_for(model.config, attn_implementation))
    if device_map is not None and source.kind == "gguf":
        _place(model, device_map)
    try:
        if device_map is None:
            model.to(target)
    except (RuntimeError, AssertionError) as exc:  # e.g. CUDA asked for on a CPU-only torch
        raise ModelError(f"cannot move the model to {target}: {first_line(exc)}") from exc
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _checked_load(source: ModelSource, kwargs: dict[str, Any]) -> torch.nn.Module:
    """The model of a folder or hub id, refused where its weights leave some of its config's out
    (transformers fills them with random numbers and prints a table: the model ran, its text garbage) and
    said in one line where the weights hold tensors the model does not read (a checkpoint's extra heads are
    legitimate; a config with fewer layers than the weights is not)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report: what is said below, in one line
    try:
        model, info = hub_load(
            source,
            AutoModelForCausalLM.from_pretrained,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # (refused below, by name: it raised pointing at the report)
            **kwargs,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        key, found, wanted = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ModelError(
            f"the weights of '{source.name}' hold {key} of shape {tuple(found)} where its config.json asks "
            f"for {tuple(wanted)}{more}"
        )
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    if missing:
        raise ModelError(
            f"the weights of '{source.name}' lack {len(missing)} tensors its config.json asks for "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): they would be random numbers"
        )
    if unexpected:
        log.warning(
            "the weights of '%s' hold %d tensors the model does not read (%s%s)",
            source.name,
            len(unexpected),
            ", ".join(unexpected[:3]),
            ", ..." if len(unexpected) > 3 else "",
        )
    return model


def _cast_float_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating parameters and buffers outside int8 layers to ``dtype`` (their scales stay)."""
    for module in model.modules():
        if isinstance(module, Int8Linear):
            continue
        for name, p in module._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                module._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype and "inv_freq" not in name:
                module._buffers[name] = b.to(dtype)
