"""The rows of one decode step (:meth:`~selfextend.generation.decode.DecodeStep.rows`): each row's position in
its cache (several rows of one cache: a speculative check's drafted tokens, in order), what the step knows
of them for one token, and Self-Extend's query rotation shared by the layers of one setting."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from selfextend.core.positions import grouped_query_positions
from selfextend.core.rope import Rotation
from selfextend.hf.patch import SelfExtendParams
from selfextend.kv.cache import ContextShiftCache
from selfextend.native.decode import NativeKernels, rotation_fits


def query_rotation(
    known: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], pos: int, p: SelfExtendParams, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (rot_dim,) of the rotation that takes a query at ``pos`` to its grouped position under
    ``p``, computed (and checked for the native ``rope_write`` of head size ``d``) once per token for the
    layers sharing ``p``'s settings (``known``)."""
    delta = grouped_query_positions(pos, p.group_size, p.window) - pos
    key = (delta, id(p.inv_freq))
    if key not in known:
        r = Rotation.of(torch.tensor([delta], device=p.inv_freq.device), p.inv_freq)
        known[key] = r.cos.reshape(-1).contiguous(), r.sin.reshape(-1).contiguous()
        if not rotation_fits(known[key], d):
            raise ValueError(f"Self-Extend's rotation of {r.cos.shape[-1]} dims does not fit heads of {d}")
    return known[key]


def row_positions(caches: Sequence[ContextShiftCache]) -> list[int]:
    """Each row's position: its cache's next one, and for a cache that several rows share (a speculative
    check of drafted tokens) the next ones in row order."""
    seen: dict[int, int] = {}
    pos = []
    for cache in caches:
        before = seen.get(id(cache), 0)
        pos.append(cache.n_past + before)
        seen[id(cache)] = before + 1
    return pos


def rows_of_a_cache(caches: Sequence[ContextShiftCache]) -> int:
    """The most rows that share one cache."""
    counts: dict[int, int] = {}
    for cache in caches:
        counts[id(cache)] = counts.get(id(cache), 0) + 1
    return max(counts.values())


class RowBatch(NamedTuple):
    """What :meth:`DecodeStep.rows` knows of its rows for one token: their caches and positions, the native
    kernels that read each cache (None: torch attention), each row's rotation by kind of layer, and the
    Self-Extend query rotations computed so far (shared by the layers)."""

    caches: Sequence[ContextShiftCache]
    pos: list[int]
    kernels: list[NativeKernels | None]
    flat: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # row j's (cos, sin) (rot_dim,) by kind
    grouped: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]
