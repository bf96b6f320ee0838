"""GGUF families transformers' GGUF tables lack or read partly, completed as llama.cpp reads them.

transformers builds a GGUF's config from a per-architecture table of metadata keys
(``GGUF_CONFIG_MAPPING``) and names its tensors through gguf's name map and a per-architecture
processor (``TENSOR_PROCESSORS``). Its tables have no OLMo 2, Granite or Gemma (1) entry, leave out
Gemma 2's soft-capping keys and the MoE families' expert sizes, and read a Mixtral file (written under
the ``llama`` architecture with ``expert_count``) as a dense Llama. :func:`register` adds those keys
to transformers' config table (read by ``AutoConfig.from_pretrained(..., gguf_file=...)``);
:func:`complete_config` then sets what no key renaming gives, by llama.cpp's rules
(``src/models/<arch>.cpp``): a Mixtral config for a ``llama`` file with experts, Gemma 2/3's query
scale (``1/sqrt(head size)``, ``1/sqrt(hidden/heads)`` for the 27B shapes) and sliding layers;
:func:`tensor_names` names a file's tensors (the family's processor: q/k rows un-permuted for Llama's
kin, Gemma's "+1" norms undone, expert tensors stacked into transformers' fused ``gate_up_proj``).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from selfextend.hf.facts import ModelError
from selfextend.models.gguf_rope import TENSORS as ROPE_TENSORS

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

_DENSE = {  # the keys every llama-like family writes (TextModel.set_gguf_parameters)
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": None,
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}

# architecture (transformers' spelling) -> the metadata keys added to transformers' table
CONFIG_KEYS: dict[str, dict[str, str | None]] = {
    "olmo2": dict(_DENSE),
    "granite": {
        **_DENSE,
        "attention.scale": "attention_multiplier",
        "embedding_scale": "embedding_multiplier",
        "residual_scale": "residual_multiplier",
        "logit_scale": "logits_scaling",
    },
    "gemma": {**_DENSE, "attention.key_length": "head_dim"},
    "llama": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    "gemma2": {
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    },
    "gemma3": {
        "final_logit_softcapping": "final_logit_softcapping",
        "attention.sliding_window_pattern": "sliding_window_pattern",
    },
    "qwen2_moe": {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
}

_PERMUTED = {"llama", "granite"}  # llama.cpp's "normal" rope: q/k rows interleaved by the converter
_PLUS_ONE = {"gemma", "gemma2", "gemma3"}  # norms stored as 1 + weight
_LARGE = {"gemma2": 46, "gemma3": 62}  # layers of the 27B shapes, whose query scale is 1/sqrt(hidden/heads)
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's default: every n-th layer attends in full


def register() -> None:
    """Add :data:`CONFIG_KEYS` to transformers' GGUF config table (idempotent)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    for arch, keys in CONFIG_KEYS.items():
        GGUF_CONFIG_MAPPING.setdefault(arch, {}).update(keys)
        if arch not in GGUF_SUPPORTED_ARCHITECTURES:
            GGUF_SUPPORTED_ARCHITECTURES.append(arch)


def complete_config(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` (transformers' reading of a GGUF) with what llama.cpp derives besides the keys: a
    Mixtral config for a ``llama`` file with experts, Gemma 2/3's query scale and sliding layers."""
    from transformers import MixtralConfig

    kind = config.model_type
    if kind in ("llama", "mistral") and getattr(config, "num_local_experts", None):
        values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        config = MixtralConfig(**values)
    if kind in ("gemma2", "gemma3_text"):
        arch = "gemma2" if kind == "gemma2" else "gemma3"
        heads, hidden = config.num_attention_heads, config.hidden_size
        large = config.num_hidden_layers == _LARGE[arch]
        config.query_pre_attn_scalar = hidden // heads if large else config.head_dim
        config.layer_types = _layer_types(config, arch)
        if arch == "gemma2" and config.sliding_window is None:
            config.sliding_window = 4096  # llama.cpp's default for Gemma 2
    return config


def _layer_types(config: PretrainedConfig, arch: str) -> list[str]:
    """Each layer's attention kind as llama.cpp sets it (``hparams.set_swa_pattern``): the file's
    ``sliding_window_pattern`` (one flag a layer, or n: every n-th layer in full), else the family's."""
    layers = config.num_hidden_layers
    if arch == "gemma3" and not config.sliding_window:
        return ["full_attention"] * layers
    pattern = getattr(config, "sliding_window_pattern", None) or _SWA_PATTERN[arch]
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def tensor_names(model: nn.Module, architecture: str) -> tuple[Any, dict[str, str]]:
    """The tensor processor for a file of ``architecture`` and its map from GGUF tensor names to
    ``model``'s (a meta skeleton whose state names give the map)."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config = model.config.to_dict()
    experts = _is_moe(model)
    if experts:
        processor: Any = _MoeProcessor(config, architecture in _PERMUTED)
    elif architecture in TENSOR_PROCESSORS:
        processor = TENSOR_PROCESSORS[architecture](config=config)
    elif architecture in _PERMUTED:
        processor = TENSOR_PROCESSORS["llama"](config=config)
    elif architecture in _PLUS_ONE:
        processor = TENSOR_PROCESSORS["gemma2"](config=config)
    else:
        processor = TensorProcessor(config=config)
    # transformers builds gguf's name map over every layer once per module it visits (layers x modules
    # maps: 28 s for a 62-layer Gemma 3 on one core); one map per (architecture, layers) is the same map
    import gguf

    built = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(built)
    try:
        return processor, get_gguf_hf_weights_map(model, processor, model_type=architecture)
    finally:
        gguf.get_tensor_name_map = built


def _is_moe(model: nn.Module) -> bool:
    return any(name.endswith("experts.gate_up_proj") for name, _ in model.named_parameters())


def _processor_base() -> type:
    from transformers.modeling_gguf_pytorch_utils import Qwen2MoeTensorProcessor

    return Qwen2MoeTensorProcessor


class _MoeProcessor:
    """The MoE families' tensors: experts stacked as transformers fuses them (the gate and up experts
    into ``gate_up_proj``, as Qwen2-MoE's processor does, handed over in ``parsed_parameters``), and
    for a Mixtral file (``llama`` architecture) the q/k rows un-permuted."""

    _QK = re.compile(r".*\.attn_(q|k)\.(weight|bias)$")

    def __init__(self, config: dict[str, Any], permuted: bool) -> None:
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

        self.config = config
        self._experts = _processor_base()(config=config)
        self._llama = LlamaTensorProcessor(config=config) if permuted else None

    def preprocess_name(self, hf_name: str) -> str:
        return self._experts.preprocess_name(hf_name)

    def perform_fallback_tensor_mapping(self, *args: Any) -> None:
        self._experts.perform_fallback_tensor_mapping(*args)

    def process(self, weights: np.ndarray, name: str, **kwargs: Any) -> Any:
        from transformers.modeling_gguf_pytorch_utils import GGUFTensor

        if self._llama is not None and self._QK.match(name):
            return self._llama.process(weights, name, **kwargs)
        if "ffn_gate_inp_shexp" in name:  # (1, hidden) in transformers, (hidden) or (1, hidden) stored
            return GGUFTensor(weights.reshape(1, -1), name, {})
        return self._experts.process(weights, name, **kwargs)


def check_tensors_fit(table: Any, config: PretrainedConfig, source: object = None) -> None:
    """ModelError naming a tensor a GGUF's metadata (its ``config``) asks for and its table (a
    :class:`~selfextend.models.gguf.GGUFTable`, which imports this module) lacks, or a
    matrix or vector (a norm, a bias) whose stored shape is not the config's, without reading any weight
    (``info``: a conversion finds them too, later; a head size of 2^30 in the metadata was shown, then
    allocated by ``generate``); the message starts with ``source`` (the file) where given."""
    import torch

    from selfextend.models.weights import RunForm, empty_model

    where = "" if source is None else f"{source}: "
    with torch.device("meta"):
        model = empty_model(config, RunForm("float", torch.float32))
    mapping = tensor_names(model, table.architecture)[1]
    try:
        check_present({t.name for t in table.tensors}, mapping, model)
    except ModelError as e:
        raise ModelError(f"{where}{e}") from None
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for t in table.tensors:
        want, got = shapes.get(mapping.get(t.name, "")), t.value_shape()
        if want is not None and got is not None and len(want) == len(got) and got != want:
            raise ModelError(f"{where}{t.name}: shape {got} where the file's metadata says {want}")
    unread = sorted(
        t.name for t in table.tensors if not read_by(t.name, mapping) and t.name not in ROPE_TENSORS
    )
    if unread:  # llama.cpp refuses such a file ("wrong number of tensors"); transformers skips them
        more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
        log.warning("tensor %s%s of the file has no place in the model: not read", unread[0], more)


def read_by(name: str, mapping: dict[str, str]) -> bool:
    """Whether the GGUF tensor ``name`` has a place in the model whose map is ``mapping`` (GGUF names, or a
    stack of experts' stem): one that has none is never read, not even by the processor (a vision tower's
    ``v.blk.0.attn_q.weight`` met Llama's query permutation and its shape failed the load)."""
    return name in mapping or name.rsplit(".", 1)[0] in mapping


def check_present(present: set[str], mapping: dict[str, str], model: nn.Module) -> None:
    """ModelError naming the GGUF tensors the config asks for that the file's (``present``) lack (the output
    head aside: a file may leave it to the embedding's), or tensors of blocks past those the config has,
    before any is read; in the file's names."""
    heads = {n for n, m in model.named_modules() if m is model.get_output_embeddings()}
    whole = [(g, name) for g, name in mapping.items() if g.endswith((".weight", ".bias"))]  # (experts: stems)
    missing = [g for g, name in whole if g not in present and name.rsplit(".", 1)[0] not in heads]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelError(f"tensor {missing[0]}{more} missing, which the file's own metadata asks for")
    blocks = {g.split(".")[1] for g in mapping if g.startswith("blk.")}
    beyond = sorted(g for g in present if g.startswith("blk.") and g.split(".")[1] not in blocks)
    if beyond:  # a block_count below the file's blocks: it ran without them (llama.cpp refuses the file)
        more = f" and {len(beyond) - 1} more" if len(beyond) > 1 else ""
        raise ModelError(
            f"tensor {beyond[0]}{more} of a block past the {len(blocks)} its metadata's block_count says"
        )
