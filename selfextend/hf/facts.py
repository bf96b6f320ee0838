"""What a model is, read from its config in one place: RoPE or not, heads, head size, trained window,
layer kinds. Everything that fails because of the model asked for raises :class:`ModelError`.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from selfextend.core.validate import one_line

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class ModelError(ValueError):
    """A model that cannot be found, loaded or used; the message is one line, printed to users as-is."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


def require_model(model: Any, what: str) -> None:
    """Refuse anything that is not a transformers model (None, a plain module, a name) with a ModelError."""
    from torch import nn

    if not isinstance(model, nn.Module) or not hasattr(getattr(model, "config", None), "model_type"):
        raise ModelError(
            f"{what} needs a transformers model (a PreTrainedModel with a config), got {type(model).__name__}"
        )


def require_weights(model: Any, what: str) -> None:
    """Refuse a model whose weights were never loaded (built on the ``meta`` device, not offloaded by a
    device map) with a ModelError: it would fail at its first forward, deep inside, with torch's words."""
    table = model.get_input_embeddings()  # a float table, or GGUF blocks held as buffers
    held = next(itertools.chain(table.parameters(), table.buffers()), None)
    if held is not None and held.device.type == "meta" and not hasattr(model, "hf_device_map"):
        raise ModelError(
            f"{what} needs a model with weights; this one's are on the meta device (never loaded): load them "
            "first (from_pretrained, or to_empty() then load_state_dict())"
        )


# Model types whose positions are learned absolute embeddings, ALiBi, relative biases or none at all.
NON_ROPE_MODEL_TYPES = frozenset(
    {
        "gpt2",
        "gpt_bigcode",
        "bloom",
        "opt",
        "mpt",
        "bert",
        "roberta",
        "distilbert",
        "t5",
        "mamba",
        "mamba2",
        "falcon_mamba",
        "rwkv",
        "xglm",
        "biogpt",
        "ctrl",
        "openai-gpt",
        "transfo-xl",
    }
)


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config for composite (e.g. vision-language) configs; the config itself otherwise."""
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        return getter(decoder=True)
    return config


def _rope_parameters(config: PretrainedConfig) -> dict[str, Any] | None:
    """The RoPE settings as one flat dict, or None without RoPE.

    transformers 5 keeps them in ``config.rope_parameters``; models with several attention kinds (Gemma 3)
    hold one dict per kind, of which the full-attention one is what matters for long context.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if not any(k in params for k in ("rope_type", "rope_theta", "type")) and all(
            isinstance(v, dict) for v in params.values()
        ):
            params = params.get("full_attention") or next(iter(params.values()))
        return dict(params)
    theta = getattr(config, "rope_theta", None)
    if theta is not None:  # configs from before rope_parameters
        scaling = getattr(config, "rope_scaling", None)
        merged = dict(scaling) if isinstance(scaling, dict) else {}
        merged.setdefault("rope_theta", theta)
        return merged
    return None


def check_rope(config: PretrainedConfig, name: str | None = None) -> None:
    """Raise :class:`ModelError` unless the model uses rotary position embeddings, and its sizes are usable
    (:data:`SIZES`).

    Self-Extend and the context shift both work by remapping RoPE positions, so a model with learned,
    ALiBi or no positions cannot be used; ``name`` is only used in the message.
    """
    text = _text_config(config)
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", "") or "unknown")
    label = name or getattr(config, "name_or_path", "") or model_type
    alibi = bool(getattr(text, "alibi", False)) or getattr(text, "position_embedding_type", None) == "alibi"
    if model_type in NON_ROPE_MODEL_TYPES or alibi:
        raise ModelError(
            f"model '{label}' ({model_type}) has no rotary position embeddings; selfextend needs a RoPE model"
        )
    if _rope_parameters(text) is None:
        if getattr(text, "rotary_dim", None):  # GPT-J, CodeGen: rotary, but outside rope_parameters
            raise ModelError(
                f"model '{label}' ({model_type}) applies its rotary embeddings in its own way, without "
                "rope_parameters; selfextend does not support it"
            )
        raise ModelError(
            f"model '{label}' ({model_type}) has no rotary position embeddings; selfextend needs a RoPE model"
        )
    _check_sizes(text, label)


SIZES = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "intermediate_size",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
"""Config fields that size the model: a whole number >= 1 where given (a config file can say anything)."""


def check_size_fields(fields: dict[str, Any], label: str) -> None:
    """:class:`ModelError` naming the first of :data:`SIZES` in ``fields`` (a config, or its JSON before
    transformers divides by them) that is given and not a whole number >= 1."""
    for name in SIZES:
        value = fields.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelError(f"model '{label}': its config's {name} is {value!r}, not a whole number >= 1")


def check_rope_fields(fields: dict[str, Any], label: str) -> None:
    """:func:`_check_scaling` for the RoPE settings in a config's JSON (``rope_parameters``, one per attention
    kind where there are several, or ``rope_scaling``), before transformers divides by them."""
    for key in ("rope_parameters", "rope_scaling"):
        params = fields.get(key)
        if isinstance(params, dict):
            kinds = [p for p in params.values() if isinstance(p, dict)] if "rope_type" not in params else []
            for one in kinds or [params]:
                _check_scaling(one, label)


def _check_sizes(text: Any, label: str) -> None:
    """:class:`ModelError` naming the field where a size is not a whole number >= 1, the query heads are no
    multiple of the KV heads, or the rotary base is not a positive number (each failed later as arithmetic:
    "integer division or modulo by zero", "0.0 cannot be raised to a negative power")."""
    check_size_fields({name: getattr(text, name, None) for name in SIZES}, label)
    heads, kv = getattr(text, "num_attention_heads", None), _kv_heads(text)
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ModelError(f"model '{label}': {kv} KV heads do not divide its {heads} attention heads")
    params = _rope_parameters(text) or {}
    theta = params.get("rope_theta", getattr(text, "rope_theta", None))
    if theta is not None and not _positive(theta):
        raise ModelError(f"model '{label}': its config's rope_theta is {theta!r}, not a positive number")
    _check_scaling(params, label)


def _positive(x: Any, least: float = 0.0) -> bool:
    """``x`` a finite number, at least ``least`` where given, else above 0."""
    number = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return number and (x >= least if least else x > 0)


def _check_scaling(params: dict[str, Any], label: str) -> None:
    """:class:`ModelError` for a RoPE scaling transformers does not know, or whose ``factor`` is not a number
    >= 1 or ``original_max_position_embeddings`` not a number >= 1 (a NaN or negative factor ran, the
    text garbage; transformers only warns of it; a zero original window ended in "math domain error")."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
        raise ModelError(f"model '{label}': its RoPE scaling type {kind!r} is not one transformers knows")
    factor, original = params.get("factor"), params.get("original_max_position_embeddings")
    if kind != "default" and factor is not None and not _positive(factor, least=1.0):
        raise ModelError(f"model '{label}': its RoPE scaling factor is {factor!r}, not a number >= 1")
    if original is not None and not _positive(original, least=1):
        raise ModelError(f"model '{label}': its original_max_position_embeddings is {original!r}, not >= 1")


@dataclass(frozen=True)
class ModelFacts:
    """The numbers of a model that matter for position remapping and KV-cache sizing."""

    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_type: str
    rope_theta: float | None
    rotary_dim: int
    trained_window: int | None
    vocab_size: int | None

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV-cache bytes one token takes over all layers: K and V, ``bytes_per_value`` each (fp16: 2)."""
        return 2 * bytes_per_value * self.head_dim * self.kv_heads * self.layers


def _kv_heads(config: PretrainedConfig) -> int | None:
    """Number of K/V heads, which configs spell several ways (Falcon-7B multi-query: always one)."""
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1
    for attr in ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"):
        value = getattr(config, attr, None)
        if value:
            return int(value)
    return None


def kv_shape(config: Any) -> tuple[int, int]:
    """(K/V heads, head dim) of a model or its config (the text part of composite configs)."""
    text = _text_config(getattr(config, "config", config))
    heads = int(text.num_attention_heads)
    return int(_kv_heads(text) or heads), int(getattr(text, "head_dim", None) or text.hidden_size // heads)


def model_facts(config: PretrainedConfig) -> ModelFacts:
    """Read a :class:`ModelFacts` from a config (the text part of composite configs)."""
    check_rope(config)
    text = _text_config(config)
    rope = _rope_parameters(text) or {}
    heads = int(text.num_attention_heads)
    kv_heads, head_dim = kv_shape(text)
    partial = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None)) or 1.0
    rotary_dim = getattr(text, "rotary_dim", None) or int(head_dim * float(partial))
    theta = rope.get("rope_theta", getattr(text, "rope_theta", None))
    window = _window(text)
    return ModelFacts(
        model_type=str(text.model_type),
        layers=int(text.num_hidden_layers),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=int(head_dim),
        rope_type=str(rope.get("rope_type") or rope.get("type") or "default"),
        rope_theta=float(theta) if theta is not None else None,
        rotary_dim=int(rotary_dim),
        trained_window=window,
        vocab_size=getattr(text, "vocab_size", None),
    )


def _window(text: PretrainedConfig) -> int | None:
    rope = _rope_parameters(text) or {}
    window = rope.get("original_max_position_embeddings") or getattr(text, "max_position_embeddings", None)
    return int(window) if window else None


def trained_window(config: Any) -> int:
    """The context length the model was trained on, before any RoPE scaling (of a model or its config; for
    several attention kinds, the full-attention one's). ModelError when the config does not say."""
    text = _text_config(getattr(config, "config", config))
    window = _window(text)
    if window is None:
        model_type = getattr(text, "model_type", "this model")
        raise ModelError(f"{model_type} does not say its trained context length")
    return window


def layer_kinds(model: Any) -> list[str]:
    """Each decoder layer's attention kind (of a model or its config): ``full_attention`` unless
    ``config.layer_types`` says otherwise (a model-wide ``sliding_window`` without layer types makes every
    layer slide)."""
    config = getattr(model, "config", model).get_text_config()
    kinds = list(getattr(config, "layer_types", None) or [])
    if kinds:
        return kinds
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return [kind] * int(config.num_hidden_layers)


def sliding_windows(config: Any) -> list[int | None]:
    """Each decoder layer's attention window (``config.sliding_window``) for its sliding layers, None for
    the full-attention ones (of a model or its config)."""
    window = getattr(getattr(config, "config", config).get_text_config(), "sliding_window", None)
    return [
        int(window) if kind == "sliding_attention" and isinstance(window, int) else None
        for kind in layer_kinds(config)
    ]


@functools.cache
def _cache_argument(forward_owner: type) -> str:
    params = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """The keyword that hands ``cache`` to ``module``'s forward: ``cache`` from transformers 5.24 on (which
    warns on every call that still says ``past_key_values``), ``past_key_values`` before it."""
    return {_cache_argument(type(module)): cache}
