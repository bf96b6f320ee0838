"""Plug Self-Extend into a transformers model through its own extension points.

We register an attention function (``AttentionInterface``) and a matching mask function
(``AttentionMaskInterface``) under the name ``selfextend`` and switch the model's
``_attn_implementation`` to it. No model class or ``forward`` is replaced, so the patch
follows transformers releases instead of breaking on them. The Self-Extend parameters live
on each attention module as ``module.self_extend``; removing the patch deletes them and
restores the previous attention implementation.

Models whose ``config.layer_types`` mix ``sliding_attention`` and ``full_attention`` (Gemma 3,
Qwen2 with ``use_sliding_window``): a sliding layer never sees a distance beyond its window, so it
needs no extension and keeps its own attention: the band ``i - j < sliding_window``, computed
block by block without the dense mask transformers would build (SDPA with that mask when there is
padding); only the full-attention layers get Self-Extend, each with its own rotary frequencies.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from selfextend.core.attention import (
    self_extend_attention,
    self_extend_attention_reference,
    sliding_window_attention,
    untagged_cells,
)
from selfextend.core.cells import cells_of
from selfextend.core.positions import max_length, validate
from selfextend.core.rope import Frequencies, RotationTable, layer_frequencies, rotate
from selfextend.core.validate import ValidationError
from selfextend.hf.facts import ModelError, check_rope, layer_kinds, require_model, trained_window
from selfextend.hf.masks import padding_mask, query_positions, split_padding, written

IMPLEMENTATION = "selfextend"
REFERENCE_IMPLEMENTATION = "selfextend_reference"


@dataclass
class OwnAttention:
    """Marks a layer that keeps its own attention under the patch (a sliding-window layer)."""

    previous_implementation: str


@dataclass
class Reach:
    """The longest input Self-Extend G, W reaches on a model (:func:`~selfextend.core.positions.max_length`)
    and whether a longer one was said: one warning per :func:`apply_self_extend` (a library user got none,
    and read garbage past it), from whichever layer, cache or command meets it first."""

    length: int
    group_size: int
    window: int
    said: bool = False

    def check(self, n: int, what: str = "an input of") -> None:
        """Warn once where ``n`` positions are past the reach (quality falls past it, as the plain model's
        past its trained window)."""
        if n > self.length and not self.said:
            self.said = True
            g, w = self.group_size, self.window
            warnings.warn(
                f"{what} {n:,} tokens is past what Self-Extend G={g}, W={w} reaches on this model "
                f"({self.length:,} tokens): quality falls past it; raise the group size",
                stacklevel=4,  # ContextShiftCache's caller
            )


@dataclass
class SelfExtendParams:
    """What one attention layer needs: group size, window and where its rotary frequencies live."""

    group_size: int
    window: int
    rotary: Frequencies
    previous_implementation: str
    rotations: RotationTable = field(default_factory=RotationTable)  # the decode query's rotation, shared
    reach: Reach | None = None  # shared by the model's layers: said once

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.rotary.inv_freq


def _check_supported(kwargs: dict[str, Any]) -> None:
    if kwargs.get("sliding_window") is not None:
        raise ModelError("selfextend does not extend sliding-window attention layers")
    if kwargs.get("output_attentions"):  # said as transformers' sdpa says it: the weights are never made
        warnings.warn(
            "selfextend attention returns no attention weights (output_attentions=True)", stacklevel=3
        )


def _own_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    **kwargs: Any,
) -> tuple[torch.Tensor, None] | None:
    """A sliding layer's own attention, or None for a layer Self-Extend serves.

    A prefill without padding got no mask from the mask function, and the band ``i - j < sliding_window``
    is attended block by block (:func:`sliding_window_attention`, soft-capped where the model caps). A
    decode step, or padding, runs the attention the model ran before the patch with transformers' mask
    (made additive for eager attention): the unpatched model's very path, so its numbers are the plain
    model's.
    """
    settings = getattr(module, "self_extend", None)
    if settings is None:
        raise ModelError(
            f"layer {module.layer_idx} is set to selfextend attention but has no Self-Extend settings: its "
            "config was switched by apply_self_extend on another model built from the same config object "
            "(transformers models share the one they are given); call apply_self_extend on this model too, "
            "or build it from a copy of the config"
        )
    if not isinstance(settings, OwnAttention):
        return None
    window = kwargs.get("sliding_window")
    if attention_mask is None and window is not None and query.shape[2] > 1:
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        q_pos = query_positions(kwargs, query.shape[0], query.shape[2], key.shape[2], query.device)
        cells, cap = cells_of(key), kwargs.get("softcap")
        out = sliding_window_attention(query, key, value, int(window), scale, q_pos, cells, cap)
        return out.transpose(1, 2).contiguous(), None
    previous = module.self_extend.previous_implementation
    if previous in ALL_ATTENTION_FUNCTIONS:
        attend = ALL_ATTENTION_FUNCTIONS[previous]
    else:  # eager: the model's own function
        attend = sys.modules[type(module).__module__].eager_attention_forward
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            blocked = torch.finfo(query.dtype).min
            additive = torch.zeros_like(attention_mask, dtype=query.dtype)
            attention_mask = additive.masked_fill(~attention_mask, blocked)
    return attend(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def self_extend_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered ``selfextend`` attention: query (B, H, Lq, D) -> output (B, Lq, H, D). No attention
    dropout (a model in training mode is told once)."""
    own = _own_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if own is not None:
        return own
    _check_supported(kwargs)
    if dropout:
        warnings.warn(f"selfextend attention applies no dropout (the model's is {dropout})", stacklevel=2)
    params: SelfExtendParams = module.self_extend
    b, _, lq, _ = query.shape
    cells = cells_of(key)
    q_pos = query_positions(kwargs, b, lq, key.shape[2], query.device)
    if cells is None:
        key, value = written(key, value, q_pos)
    lk = key.shape[2]
    if params.reach is not None:
        params.reach.check(lk)
    pads = split_padding(attention_mask, lk)

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, pad: int | None = None
    ) -> torch.Tensor:
        c = cells.drop(pad) if cells is not None and pad is not None else cells  # one row, after its padding
        g, w, inv_freq, cap = params.group_size, params.window, params.inv_freq, kwargs.get("softcap")
        return self_extend_attention(q, k, v, pos, g, w, inv_freq, scaling, c, params.rotations, cap)

    if pads is None:
        out = run(query, key, value, q_pos)
    else:
        # Each row on its own, without its padding slots: left padding means "these slots don't exist".
        out = torch.zeros_like(query)
        off = lk - lq
        for row in range(b):
            pad = int(pads[row])
            first_q = max(0, pad - off)
            if first_q >= lq:
                continue
            sl = slice(row, row + 1)
            pos = q_pos[sl, first_q:]
            if (
                cells is None
            ):  # counted from the row's first token, as alone (transformers counts the padding)
                pos = pos - (pos[:, -1:] - (lk - pad - 1))
            out[sl, :, first_q:] = run(query[sl, :, first_q:], key[sl, :, pad:], value[sl, :, pad:], pos, pad)
    return out.transpose(1, 2).contiguous(), None


def reference_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered ``selfextend_reference`` attention: un-rotate q/k, then the full-matrix math.

    Quadratic memory; for tests and for benchmarks against the official approach. Sliding layers keep
    their own attention, as with ``selfextend``.
    """
    own = _own_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if own is not None:
        return own
    _check_supported(kwargs)
    params: SelfExtendParams = module.self_extend
    b, _, lq, _ = query.shape
    q_pos = query_positions(kwargs, b, lq, key.shape[2], query.device)
    if cells_of(key) is None:
        key, value = written(key, value, q_pos)
    lk = key.shape[2]
    cells = cells_of(key) or untagged_cells(key, q_pos)
    k_pos = cells.positions.to(query.device).expand(b, -1)  # (B, Lk)
    key_mask = None
    if attention_mask is not None:
        key_mask = attention_mask[:, -lk:].bool()
    q_raw = rotate(query, -q_pos, params.inv_freq)
    k_raw = rotate(key, -k_pos, params.inv_freq)
    out = self_extend_attention_reference(
        q_raw,
        k_raw,
        value,
        q_pos,
        k_pos,
        params.group_size,
        params.window,
        params.inv_freq,
        scale=scaling,
        key_mask=key_mask,
        softcap=kwargs.get("softcap"),
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(IMPLEMENTATION, self_extend_attention_forward)
AttentionInterface.register(REFERENCE_IMPLEMENTATION, reference_attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, padding_mask)
AttentionMaskInterface.register(REFERENCE_IMPLEMENTATION, padding_mask)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a decoder (the ones that call the attention interface)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx") and hasattr(m, "config")
    ]


def _check_model(model: nn.Module) -> list[str]:
    """The layer kinds, after refusing what Self-Extend cannot serve (one-line :class:`ModelError`)."""
    config = model.config
    check_rope(config)
    kinds = layer_kinds(model)
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ModelError(
            f"{config.model_type} has {', '.join(unknown)} layers; selfextend does not support them"
        )
    if "full_attention" not in kinds:
        raise ModelError(
            f"{config.model_type} uses sliding-window attention in every layer, so nothing attends far "
            "enough to extend (set config.sliding_window = None if the model allows it)"
        )
    return kinds


def apply_self_extend(
    model: nn.Module, group_size: int, window: int, implementation: str = IMPLEMENTATION
) -> nn.Module:
    """Switch ``model`` to Self-Extend attention in place and return it (its full-attention layers;
    sliding-window layers of hybrid models keep their own attention).

    ``group_size`` G >= 1 and ``window`` W >= 1 with W below the trained window; the model then
    reads up to ``max_length(trained, G, W)`` tokens. ``implementation="selfextend_reference"``
    selects the full-matrix reference (quadratic memory). Calling it again changes the settings. The
    attention implementation is set on ``model.config`` (transformers' ``set_attn_implementation``), which
    a model shares with the config object it was built from: a model built later from that object runs
    Self-Extend attention and is refused at its first forward until it is patched too.
    Raises :class:`~selfextend.core.validate.ValidationError` for bad G/W and
    :class:`~selfextend.models.ModelError` for a model it cannot patch (both ``ValueError``).
    """
    require_model(model, "apply_self_extend")
    if implementation not in (IMPLEMENTATION, REFERENCE_IMPLEMENTATION):
        raise ValidationError(
            "implementation",
            f"must be '{IMPLEMENTATION}' or '{REFERENCE_IMPLEMENTATION}', got {implementation!r}",
        )
    kinds = _check_model(model)
    group_size, window = validate(group_size, window, trained_window(model.config))
    modules = attention_modules(model)
    if not modules:
        raise ModelError(f"{type(model).__name__}: no attention modules found")
    frequencies = layer_frequencies(model)
    rotations = RotationTable()  # one table for all layers: a decode step rotates each by the same deltas
    reach = Reach(max_length(trained_window(model.config), group_size, window), group_size, window)
    previous = model.config._attn_implementation
    if previous in (IMPLEMENTATION, REFERENCE_IMPLEMENTATION):
        previous = modules[0].self_extend.previous_implementation
    for m in modules:
        if kinds[m.layer_idx] == "full_attention":
            freq = frequencies[m.layer_idx]
            m.self_extend = SelfExtendParams(group_size, window, freq, previous, rotations, reach)
        else:
            m.self_extend = OwnAttention(previous)
    model.set_attn_implementation(implementation)
    return model


def remove_self_extend(model: nn.Module) -> nn.Module:
    """Undo ``apply_self_extend``: the previous attention implementation, no leftovers."""
    require_model(model, "remove_self_extend")
    modules = [m for m in attention_modules(model) if hasattr(m, "self_extend")]
    if not modules:
        return model
    previous = modules[0].self_extend.previous_implementation
    for m in modules:
        del m.self_extend
    model.set_attn_implementation(previous)
    return model


@contextmanager
def self_extend(
    model: nn.Module, group_size: int, window: int, implementation: str = IMPLEMENTATION
) -> Iterator[nn.Module]:
    """``with self_extend(model, G, W):`` Self-Extend G, W inside the block; after it, the model as it was
    before (plain, or with the Self-Extend settings it had: blocks nest). Arguments and exceptions as
    :func:`apply_self_extend`'s."""
    require_model(model, "self_extend")
    before = {m: m.self_extend for m in attention_modules(model) if hasattr(m, "self_extend")}
    previous = model.config._attn_implementation
    apply_self_extend(model, group_size, window, implementation)
    try:
        yield model
    finally:
        remove_self_extend(model)
        for m, params in before.items():
            m.self_extend = params
        if before:
            model.set_attn_implementation(previous)


def check_reach(model: nn.Module, n: int, what: str = "an input of") -> None:
    """Warn (once per :func:`apply_self_extend`) where ``n`` positions are past what the model's Self-Extend
    reaches; nothing for a model without it."""
    extended = (getattr(m, "self_extend", None) for m in attention_modules(model))
    params = next((p for p in extended if isinstance(p, SelfExtendParams)), None)
    if params is not None and params.reach is not None:
        params.reach.check(n, what)


def max_usable_length(model_or_config: Any, group_size: int, window: int) -> int:
    """Largest length this model (or config) reaches with Self-Extend G, W: ``(L - W) * G + W`` where G
    divides W (:func:`~selfextend.core.positions.max_length`: a few tokens fewer where it does not).

    Refuses (:class:`~selfextend.core.validate.ValidationError`) a window not smaller than the trained one,
    and (:class:`ModelError`) a model without rotary positions.
    """
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "model_type"):
        got = type(model_or_config).__name__
        raise ModelError(f"max_usable_length needs a model or its config, got {got}")
    check_rope(config)  # before the window is looked for: BLOOM has none, and no rotary positions either
    return max_length(trained_window(config), group_size, window)
