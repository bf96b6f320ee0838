"""A GGUF's rotary embedding and head sizes read as llama.cpp reads them, into its config
(:func:`apply_gguf_rope`; the config itself: :mod:`selfextend.models.gguf_config`).

transformers builds a GGUF's config from a per-architecture table of metadata keys that leaves out most
of what sets the rotation: llama.cpp's converter writes Llama 3's scaling only as the ``rope_freqs``
tensor (one divisor per frequency) and Phi-3's long-rope as ``rope_factors_long/short`` tensors, and the
``rope.scaling.*`` keys (linear, YaRN), ``rope.dimension_count`` (partial rotary) and
``attention.key_length`` (head size) are read for a few architectures only. Here they become the
config's ``rope_parameters`` and ``head_dim``, so that every path built from the config (the model's
rotary module, hence the forward, the decode steps' factors, the K-shift and Self-Extend's rotations
that read its ``inv_freq``; the converted model's saved ``config.json``; the prompt cache's fingerprint
of the config) computes with the file's frequencies.

The rules are llama.cpp's (``llama_model::load_hparams``, ``llama_context``'s YaRN settings,
``get_rope_factors``): a ``rope_freqs`` tensor divides each frequency; long-rope factors come with the
file's ``rope.scaling.attn_factor`` (1 without it); YaRN's attention factor is ``0.1 ln(factor) + 1``
(with ``yarn_log_multiplier``: the ratio of two such terms) times ``rope.scaling.attn_factor``. Which
long-rope set applies follows transformers (the long one once a position passes the original window);
llama.cpp picks it once, by its context size.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from selfextend.hf.facts import ModelError

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

# the metadata keys read here, after ``<arch>.``
KEYS = (
    "context_length",
    "embedding_length",
    "attention.head_count",
    "attention.key_length",
    "attention.value_length",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.attn_factor",
    "rope.scaling.yarn_log_multiplier",
    "rope.scaling.yarn_ext_factor",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
)
PARTIAL_ROTARY = frozenset({"phi3", "stablelm"})
"""Model types whose transformers attention rotates the first ``partial_rotary_factor`` of a head only; in
the others a ``rope.dimension_count`` short of the head size failed deep in the load, or ran wrong."""
TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class GGUFRope:
    """What a GGUF says about its rotation and head sizes: the :data:`KEYS` it has, the :data:`TENSORS`."""

    keys: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, reader: GGUFReader, architecture: str) -> GGUFRope:
        """Read from an open reader (the tensors are small: one value per frequency)."""
        from gguf import dequantize
        from transformers.modeling_gguf_pytorch_utils import read_field

        keys = {}
        for key in KEYS:
            if f"{architecture}.{key}" in reader.fields:
                value = read_field(reader, f"{architecture}.{key}")
                keys[key] = value[0] if len(value) == 1 else value
        tensors = {
            t.name: dequantize(np.array(t.data), t.tensor_type).astype(np.float32).reshape(-1)
            for t in reader.tensors
            if t.name in TENSORS
        }
        return cls(keys, tensors)


def _llama3_factors(params: dict[str, Any], dim: int) -> np.ndarray:
    """The divisors llama.cpp's converter writes as ``rope_freqs`` for ``rope_type: llama3`` (its formula,
    in float32 as there), so that parameters recovered from a file are checked against the file's own."""
    base, factor = params["rope_theta"], params["factor"]
    low, high, old = (
        params["low_freq_factor"],
        params["high_freq_factor"],
        params["original_max_position_embeddings"],
    )
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def llama3_parameters(factors: np.ndarray, theta: float, dim: int) -> dict[str, Any] | None:
    """The ``llama3`` rope parameters whose divisors are ``factors`` (a ``rope_freqs`` tensor), or None.

    Divisors are 1 at high frequencies, ``factor`` at low ones and ``1 / ((1 - s) / factor + s)`` between,
    with ``s = A / wavelength - B`` (``A = old / (high - low)``, ``B = low / (high - low)``): ``factor`` is
    the largest divisor and a line through the middle ones gives A and B (one middle divisor: B = 1/3, Llama
    3's), hence, with ``low_freq_factor`` 1 (any ``low`` with the same A and B gives the same divisors),
    ``high = 1 + 1 / B`` and ``old = A / B``.
    The result is recomputed as the converter does and kept only if it gives the file's divisors.
    """
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelen = (2 * math.pi / freqs).double().numpy()
    mid = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    if not mid.any():
        return None
    s = (1 / factors[mid].astype(np.float64) - 1 / factor) / (1 - 1 / factor)
    if mid.sum() == 1:  # one point: Llama 3's high_freq_factor 4 (B = 1/3), A through the point
        b, slope = 1 / 3, (s[0] + 1 / 3) * wavelen[mid][0]
    else:
        slope, intercept = np.polyfit(1 / wavelen[mid], s, 1)  # s = A / wavelength - B
        b = -intercept
    if slope <= 0 or b <= 0:
        return None
    params = {
        "rope_type": "llama3",
        "rope_theta": float(theta),
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": round(float(1 + 1 / b), 4),
        "original_max_position_embeddings": int(round(float(slope / b))),
    }
    if len(factors) != dim // 2 or not np.allclose(_llama3_factors(params, dim), factors, rtol=1e-5, atol=0):
        return None
    return params


def _per_frequency(factors: np.ndarray, original: int) -> dict[str, Any]:
    """Divisors given one per frequency, as a rope type transformers takes (long-rope with one set, no
    attention factor): each inverse frequency is ``1 / (divisor * theta ** (2i / d))``."""
    values = [float(x) for x in factors]
    return {
        "rope_type": "longrope",
        "short_factor": values,
        "long_factor": values,
        "original_max_position_embeddings": int(original),
        "attention_factor": 1.0,
        "factor": 1.0,
    }


def _yarn_attention(factor: float, keys: dict[str, Any]) -> float:
    """llama.cpp's YaRN attention factor (``llama_context``: ``get_mscale`` with ``yarn_log_multiplier``,
    times ``rope.scaling.attn_factor``)."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1.0 else 0.1 * m * math.log(scale) + 1.0

    log_mul = float(keys.get("rope.scaling.yarn_log_multiplier", 0.0))
    found = mscale(factor) / mscale(factor, log_mul) if log_mul else mscale(factor)
    return found * float(keys.get("rope.scaling.attn_factor", 1.0))


def _scaling(rope: GGUFRope, theta: float, rot_dim: int, original: int) -> dict[str, Any] | None:
    """The rope parameters of the file's scaling (None: plain RoPE)."""
    keys, tensors = rope.keys, rope.tensors
    kind = str(keys.get("rope.scaling.type", "none")).lower()
    factor = float(keys.get("rope.scaling.factor", 0.0) or 1.0)
    original = int(keys.get("rope.scaling.original_context_length", original))
    if "rope_freqs.weight" in tensors:
        factors = tensors["rope_freqs.weight"]
        if np.all(factors == 1.0):
            return None
        return llama3_parameters(factors, theta, rot_dim) or _per_frequency(factors, original)
    if "rope_factors_long.weight" in tensors:
        long = [float(x) for x in tensors["rope_factors_long.weight"]]
        short = [float(x) for x in tensors.get("rope_factors_short.weight", long)]
        return {
            "rope_type": "longrope",
            "long_factor": long,
            "short_factor": short,
            "original_max_position_embeddings": original,
            "attention_factor": float(keys.get("rope.scaling.attn_factor", 1.0)),
        }
    if kind == "linear" and factor != 1.0:
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        if float(keys.get("rope.scaling.yarn_ext_factor", 1.0)) != 1.0:
            raise ModelError("a YaRN extrapolation factor other than 1 is not supported")
        params = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original,
            "attention_factor": _yarn_attention(factor, keys),
        }
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"rope.scaling.{key}" in keys:
                params[name] = float(keys[f"rope.scaling.{key}"])
        return params
    if kind not in ("none", "linear", "longrope"):
        raise ModelError(f"RoPE scaling type '{kind}' is not supported")
    return None


def apply_gguf_rope(config: PretrainedConfig, rope: GGUFRope, name: str = "") -> None:
    """Put the file's head size and rotation into ``config`` (its text part), in place.

    ``head_dim`` becomes ``attention.key_length`` (ModelError when values have another size); RoPE's base,
    its partial dimension count and its scaling (see the module docstring) go into ``rope_parameters``
    (the full-attention part of per-kind parameters).
    """
    text = config.get_text_config()
    keys = rope.keys
    heads = int(getattr(text, "num_attention_heads", 0) or keys.get("attention.head_count", 1))
    key_len, value_len = keys.get("attention.key_length"), keys.get("attention.value_length")
    if key_len and value_len and int(value_len) != int(key_len):
        label = name or "the model"
        raise ModelError(
            f"{label}: value heads of {value_len} values and key heads of {key_len} are not supported"
        )
    # llama.cpp's head size: key_length, else the width over the heads (transformers maps a Llama's
    # rope.dimension_count to head_dim, which a partial count made the wrong size)
    head_dim = int(key_len) if key_len else int(text.hidden_size) // heads
    text.head_dim = head_dim
    params = dict(getattr(text, "rope_parameters", None) or {})
    nested = "full_attention" in params and isinstance(params["full_attention"], dict)
    target = dict(params["full_attention"]) if nested else params
    if "rope.freq_base" in keys and not nested:
        target["rope_theta"] = float(keys["rope.freq_base"])
    theta = float(target.get("rope_theta", 10000.0))
    rot_dim = int(keys.get("rope.dimension_count") or head_dim)
    if rot_dim > head_dim:
        raise ModelError(
            f"{name or 'the model'}: rope.dimension_count {rot_dim} asks to rotate more values than a head "
            f"holds ({head_dim})"
        )
    if rot_dim != head_dim and config.model_type not in PARTIAL_ROTARY:
        raise ModelError(
            f"{name or 'the model'}: rope.dimension_count {rot_dim} rotates part of a head of {head_dim} "
            f"values, which a {config.model_type} model does not do (llama.cpp refuses such a Llama file too)"
        )
    if "rope.dimension_count" in keys:
        target["partial_rotary_factor"] = rot_dim / head_dim
    original = int(getattr(text, "max_position_embeddings", 0) or keys.get("context_length", 4096))
    scaling = _scaling(rope, theta, rot_dim, original)
    if scaling is not None:
        for stale in ("factor", "attention_factor", "long_factor", "short_factor", "low_freq_factor"):
            target.pop(stale, None)
        target.update(scaling)
        log.info("%s: RoPE %s from the file", name or "GGUF", scaling["rope_type"])
    if nested:
        params["full_attention"] = target
    text.rope_parameters = params
