"""Rotary position embedding: extra rotations of vectors that are already rotated.

RoPE rotations compose: a vector rotated at position ``p`` and then by ``d`` equals the
vector rotated at ``p + d``. Keys cached after RoPE can therefore be moved to grouped
positions (Self-Extend) or to compacted positions (context shift) by one rotation of the
difference. The rotation is done in float32 with the model's own inverse frequencies and
without any ``attention_scaling`` factor: it must be a pure rotation.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Rotation(NamedTuple):
    """Factors of a rotation by some deltas: ``cos`` and ``sin`` (B, 1, L, rot_dim) in float32.

    The sign of the Llama convention's ``rotate_half`` (-x2, x1) is folded into ``sin``.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def of(cls, delta: torch.Tensor, inv_freq: torch.Tensor) -> Rotation:
        """The rotation by ``delta`` positions, ``delta`` (B, L) or (L,).

        Angles and their cos/sin are computed in float64 (where the device has it): in float32 the angle
        ``delta * inv_freq`` of a 1024-position shift is off by up to half an ulp of 1024 rad (3e-5), the
        same error at every shift of that size, so keys that survive many shifts drift linearly
        (experiments/quality/kshift_drift.py: 0.19 on keys of magnitude 20 after 1000 shifts, 1.6e-4 after
        one).
        """
        wide = torch.float32 if inv_freq.device.type == "mps" else torch.float64
        delta = delta.to(device=inv_freq.device, dtype=wide)
        if delta.dim() == 1:
            delta = delta[None]  # (1, L)
        angles = delta[:, None, :, None] * inv_freq.to(wide)  # (B, 1, L, rot_dim / 2)
        angles = torch.cat((angles, angles), dim=-1)  # (B, 1, L, rot_dim)
        return cls.from_cos_sin(angles.cos(), angles.sin())

    @classmethod
    def from_cos_sin(cls, cos: torch.Tensor, sin: torch.Tensor) -> Rotation:
        """From the (..., rot_dim) cos and sin of the Llama convention (what rotary modules return)."""
        half = sin.shape[-1] // 2
        return cls(cos.float(), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).float())

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (B, H, L, D): ``x * cos + swap_halves(x) * sin`` over the first ``rot_dim``
        dimensions (the rest pass through, for partial rotary models); float32 inside, ``x.dtype`` out."""
        rot_dim = self.cos.shape[-1]
        half = rot_dim // 2
        x_rot = x[..., :rot_dim].float()
        swapped = torch.cat((x_rot[..., half:], x_rot[..., :half]), dim=-1)
        out = torch.addcmul(x_rot * self.cos, swapped, self.sin)
        if rot_dim < x.shape[-1]:
            out = torch.cat((out, x[..., rot_dim:].float()), dim=-1)
        return out.to(x.dtype)


def rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, L, D) by ``delta`` positions; ``delta`` broadcasts to (B, L) or (L,).

    Only the first ``2 * len(inv_freq)`` dimensions rotate (partial rotary models); the rest
    pass through. Computed in float32, returned in ``x.dtype``.
    """
    return Rotation.of(delta, inv_freq.to(x.device)).apply(x)


class RotationTable:
    """Rotations by whole-number deltas as (D, D) matrices, built once and shared by every layer.

    A decode step rotates each layer's query and newest grouped key by the same deltas, so the
    rotation is looked up instead of recomputed 2 x n_layers times, and applied as one small
    matrix product (``x @ matrix``; the matrix is :class:`Rotation` applied to the identity, so
    the formula stays in one place). The table empties itself when it grows past
    ``max_entries`` or when the inverse frequencies change (dynamic RoPE).
    """

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self.entries: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self.inv_freq: torch.Tensor | None = None
        self.version = -1

    def matrix(
        self, delta: int, inv_freq: torch.Tensor, dim: int, device: torch.device | None = None
    ) -> torch.Tensor:
        """(dim, dim) float32 matrix of the rotation by ``delta``: ``rotate(x, delta) == x @ matrix``.

        Kept per ``device`` (default: ``inv_freq``'s), so layers that a device map placed on other
        devices each find theirs there.
        """
        device = inv_freq.device if device is None else device
        changed = inv_freq is not self.inv_freq or inv_freq._version != self.version
        if changed or len(self.entries) >= self.max_entries:
            self.entries.clear()
            self.inv_freq, self.version = inv_freq, inv_freq._version
        found = self.entries.get((delta, dim, device))
        if found is None:
            eye = torch.eye(dim, device=device)[None, None]  # (1, 1, dim, dim)
            rotation = Rotation.of(torch.tensor([delta]), inv_freq.to(device))
            found = self.entries[delta, dim, device] = rotation.apply(eye)[0, 0]
        return found

    def rotate(self, x: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
        """``rotate(x, delta, inv_freq)`` for one whole-number delta, in float32, returned in ``x.dtype``."""
        return torch.matmul(x.float(), self.matrix(delta, inv_freq, x.shape[-1], x.device)).to(x.dtype)


class Frequencies:
    """Where one layer's inverse frequencies live (a rotary module and a buffer name), read at each use
    so that a rotary embedding that updates them (dynamic RoPE) is followed."""

    def __init__(self, module: nn.Module, attr: str = "inv_freq") -> None:
        self.module, self.attr = module, attr

    @property
    def inv_freq(self) -> torch.Tensor:
        return getattr(self.module, self.attr)


def layer_frequencies(model: nn.Module) -> list[Frequencies]:
    """The inverse frequencies each decoder layer rotates with, read from the model's rotary modules.

    One rotary embedding (``inv_freq``) serves every layer of most models; models with several
    attention kinds (Gemma 3: ``sliding_attention_inv_freq`` with base 10k, ``full_attention_inv_freq``
    with base 1M) hold one buffer per kind, and layer ``i`` uses the one of ``config.layer_types[i]``.
    """
    config = model.config.get_text_config()
    layers = int(config.num_hidden_layers)
    if any(isinstance(getattr(m, "inv_freq", None), torch.Tensor) for m in model.modules()):
        return [Frequencies(find_rotary_embedding(model))] * layers
    kinds = list(getattr(config, "layer_types", None) or [])
    for m in model.modules():
        if kinds and all(isinstance(getattr(m, f"{k}_inv_freq", None), torch.Tensor) for k in kinds):
            return [Frequencies(m, f"{k}_inv_freq") for k in kinds[:layers]]
    raise ValueError(f"{type(model).__name__} has no rotary embedding (no module with inv_freq)")


def find_rotary_embedding(model: nn.Module) -> nn.Module:
    """The model's rotary embedding module (the one holding ``inv_freq``)."""
    found = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no rotary embedding (no module with inv_freq)")
    if len(found) > 1 and any(not torch.equal(found[0].inv_freq, m.inv_freq) for m in found[1:]):
        raise ValueError(f"{type(model).__name__} has several different rotary embeddings; not supported")
    return found[0]
