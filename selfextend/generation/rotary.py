"""The RoPE factors of the decode steps' tokens, from the model's own rotary module.

A decode step needs, per token, the rotation of its position for each kind of layer. Calling the model's
rotary module for it costs ~0.3 ms a kind (Gemma 3 has two), ~3% of a 270M model's token.
:class:`PositionRotations` asks the module once for a block of positions and keeps the factors, where
they depend on the position alone (the RoPE types without a sequence-length update).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from selfextend.core.rope import Rotation

Rotations = dict[str, Rotation]  # by kind of layer (full_attention, sliding_attention)
Flat = dict[str, tuple[torch.Tensor, torch.Tensor]]  # by kind: the flat (cos, sin) (rot_dim,) decode.c reads
# transformers' RoPE types whose factors are a function of the position alone ("dynamic" and "longrope"
# change the frequencies with the sequence length: `dynamic_rope_update`)
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


def rope_by_kind(rotary: nn.Module) -> bool:
    """Whether the model's rotary module takes the kind of layer (Gemma 3's: a RoPE base per kind)."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


def rotations_at(
    rotary: nn.Module, kinds: list[str], by_kind: bool, x: torch.Tensor, pos: torch.Tensor
) -> Rotations:
    """The RoPE rotation (B, 1, 1, D) of each row's position ``pos`` (B,) for each kind of layer in
    ``kinds``, from the model's own ``rotary`` module (``by_kind``: :func:`rope_by_kind`)."""
    position_ids = pos.view(-1, 1)  # (B, 1)
    if not by_kind:
        rot = Rotation.from_cos_sin(*(t[:, None] for t in rotary(x, position_ids)))
        return dict.fromkeys(set(kinds), rot)
    return {
        kind: Rotation.from_cos_sin(*(t[:, None] for t in rotary(x, position_ids, kind)))
        for kind in set(kinds)
    }


def static_rope(rotary: nn.Module) -> bool:
    """Whether every RoPE type of ``rotary`` (one, or one per kind of layer) is in :data:`STATIC_ROPE`."""
    types = getattr(rotary, "rope_type", "default")
    return set(types.values() if isinstance(types, dict) else [types]) <= STATIC_ROPE


class PositionRotations:
    """``rotations(x, pos) -> [Flat per row]``: each row's rotation at ``pos[j]`` by kind of layer, as
    :func:`rotations_at` gives it, flat (the first row of its (cos, sin) (1, 1, 1, rot_dim), as the native
    kernels read it).

    For a static RoPE type the module is asked for ``block`` positions at once and the factors are kept, up
    to ``max_bytes`` of them; positions beyond, other RoPE types, or another type or device of ``x`` than
    the kept factors' go to the module each time.
    """

    def __init__(
        self, rotary: nn.Module, kinds: list[str], block: int = 256, max_bytes: int = 32 << 20
    ) -> None:
        self.rotary, self.kinds = rotary, sorted(set(kinds))
        self.by_kind, self.static = rope_by_kind(rotary), static_rope(rotary)
        self.block, self.max_bytes = block, max_bytes
        self.rows: list[Flat] = []  # position p's flat factors by kind (views of one block's tensors)
        self.held: tuple[torch.dtype, torch.device] | None = None  # what the rows were computed for

    def _covers(self, x: torch.Tensor, top: int) -> bool:
        """Whether the kept factors hold position ``top`` for rows like ``x`` (extended where they may be)."""
        if not self.static:
            return False
        if self.held != (x.dtype, x.device) or not self.rows:
            self.rows, self.held = [], (x.dtype, x.device)
            self._extend(x, self.block)
        if top < len(self.rows):
            return True
        want = (top // self.block + 1) * self.block
        row_bytes = sum(cos.numel() * 8 for cos, _ in self.rows[0].values())  # float32 cos and sin
        if want * row_bytes > self.max_bytes:
            return False
        self._extend(x, want)
        return True

    def _extend(self, x: torch.Tensor, want: int) -> None:
        """Keep the factors of the positions from ``len(self.rows)`` to ``want``."""
        have = len(self.rows)
        at = torch.arange(have, want, device=x.device)
        found = rotations_at(self.rotary, self.kinds, self.by_kind, x[:1], at)
        n = want - have
        views = {k: (r.cos.view(n, -1).unbind(0), r.sin.view(n, -1).unbind(0)) for k, r in found.items()}
        self.rows += [{kind: (cos[i], sin[i]) for kind, (cos, sin) in views.items()} for i in range(n)]

    def __call__(self, x: torch.Tensor, pos: list[int]) -> list[Flat]:
        """Each row's flat (cos, sin) (rot_dim,) by kind, for rows ``x`` (M, 1, hidden) at positions ``pos``
        (M,): views of the kept factors where they hold the positions."""
        if self._covers(x, max(pos)):
            return [self.rows[p] for p in pos]
        at = torch.tensor(pos, device=x.device)
        found = rotations_at(self.rotary, self.kinds, self.by_kind, x, at).items()
        return [
            {k: (r.cos[j].reshape(-1).contiguous(), r.sin[j].reshape(-1).contiguous()) for k, r in found}
            for j in range(len(pos))
        ]
