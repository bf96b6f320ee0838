"""The captured decode step's elementwise work in three Triton kernels, where they run.

In torch's operations one Llama-shaped decoder layer of the step launches about fifty kernels for a token:
an RMSNorm is eight (casts, power, mean, add, rsqrt, two products), a rotation five for the queries and
five for the keys, Self-Extend fourteen more (the grouped query, the grouped key written), the gated
activation three. Captured as a CUDA graph they are no longer launched from Python, but each still takes
the GPU a launch and a ramp of a few microseconds: 32 layers make about 1,600 a token (2,000 with
Self-Extend; counted by ``tests/graph_replay.py``), of the order of reading an 8B model's weights (3.4 ms
on an H200). :mod:`~selfextend.core.fused_step_kernel` does the same arithmetic in one launch each: an
RMSNorm with the residual's add before it, the gated activation, and a token's queries and keys rotated
with every write into the cells (key, value, the key at its grouped position) and Self-Extend's grouped
query. Each rounds where the operations it replaces round, so the step computes what it did.

Why not ``torch.compile``: it fuses these too, but compiling a layer takes about a minute in every new
process (a GPU machine lent for minutes, a CLI run), and the step writes into the cache's buffers in
place, which a compiled graph copies unless it proves it need not. These are plain kernels launched from
the step, captured with it.

Where they run: :func:`fused_step_applies` (CUDA with compute capability 8.0 or more, or the CPU under
``TRITON_INTERPRET=1``; triton installed; not while ``torch.compile`` traces the step).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from selfextend.core.fused_prefill import DTYPES, interpreting, kernels_run_on, on_device, pow2
from selfextend.core.rope import Rotation

ACTIVATIONS = {"silu": False, "gelu_pytorch_tanh": True}  # transformers' names: whether it is GELU's


class RowNorm(NamedTuple):
    """An RMSNorm as the kernels compute it: ``weight`` (n,), ``eps``, and whether it multiplies by ``1 +
    weight`` in float32 (Gemma's) rather than rounding ``x / rms(x)`` to the input's type first (Llama's)."""

    weight: torch.Tensor
    eps: float
    offset: bool


class KeyWrite(NamedTuple):
    """Where :func:`fused_rope_write` writes one row's key, value and position: the cells' keys and values
    (1, Hkv, capacity, D), their positions (capacity,) int64, the slot (1,) int64, and the grouped keys
    (1, Hkv, capacity, D) or None."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    slot: torch.Tensor
    grouped: torch.Tensor | None


def fused_step_applies(x: torch.Tensor) -> bool:
    """Whether the kernels take the step's tensor ``x`` (its device and type; not while compiling, whose
    graph fuses the operations itself)."""
    if torch.compiler.is_compiling():
        return False
    return x.dtype in DTYPES and kernels_run_on(x.device)


def fused_rms_norm(
    x: torch.Tensor, norm: RowNorm, add: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, norm(s))`` for the rows of ``x`` (..., n), where ``s = x + add`` rounded to x's type (``add``
    None: ``s`` is ``x``). The norm's output is in x's type for Gemma's, in the type of ``weight * x`` for
    Llama's (the module's)."""
    from selfextend.core.fused_step_kernel import rms_norm_kernel

    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1 or (add is not None and add.shape != x.shape):
        raise ValueError(
            f"fused rms_norm: x {tuple(x.shape)}, add {None if add is None else tuple(add.shape)}"
        )
    adds = rows if add is None else add.reshape(-1, n).contiguous()
    summed = rows if add is None else torch.empty_like(rows)
    dtype = x.dtype if norm.offset else torch.promote_types(norm.weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=dtype, device=x.device)
    block = pow2(n)
    with on_device(x.device):
        rms_norm_kernel[(rows.shape[0],)](
            rows, adds, norm.weight, summed, out, n,
            rows.stride(0), adds.stride(0), summed.stride(0), out.stride(0), norm.eps,
            ADD=add is not None, OFFSET=norm.offset, BLOCK=block, num_warps=8 if block > 2048 else 4,
        )  # fmt: skip
    return summed.view(x.shape), out.view(x.shape[:-1] + (n,))


def fused_gated(y: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of the rows of ``y`` (..., 2n) = [gate, up], in y's type -> (..., n);
    ``activation`` one of :data:`ACTIVATIONS`."""
    from selfextend.core.fused_step_kernel import gated_kernel

    n = y.shape[-1] // 2
    rows = y.reshape(-1, 2 * n).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=y.dtype, device=y.device)
    block = min(1024, pow2(n))
    with on_device(y.device):
        gated_kernel[(rows.shape[0], -(-n // block))](
            rows, out, n, rows.stride(0), out.stride(0), GELU=ACTIVATIONS[activation], BLOCK=block
        )
    return out.view(y.shape[:-1] + (n,))


def fused_rope_write(
    qkv: torch.Tensor,
    n_heads: int,
    head_dim: int,
    rotation: Rotation,
    pos: torch.Tensor,
    cells: KeyWrite,
    grouped: tuple[Rotation, Rotation] | None = None,
    norms: tuple[RowNorm, RowNorm] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One row's projections ``qkv`` ((H + 2 Hkv) * D,) contiguous, at position ``pos`` (1,) int64:
    the queries and keys through their head norms (``norms``: q's and k's, or None) and rotated by
    ``rotation`` (cos and sin (rot_dim,) float32, sin signed as :class:`Rotation` keeps it); the key and
    value written at ``cells``' slot with the position (the key also at its grouped position where
    ``cells.grouped``).
    Returns the rotated queries (1, H, 1, D) in qkv's type and, with Self-Extend (``grouped``: the key and
    query tables, each (1, 1, N, rot_dim)), the grouped queries (1, H, 1, D) float32, else None."""
    from selfextend.core.fused_step_kernel import rope_write_kernel

    n_kv = cells.keys.shape[1]
    cos, sin = (t.reshape(-1) for t in (rotation.cos, rotation.sin))
    rot_dim = cos.shape[0]
    if qkv.numel() != (n_heads + 2 * n_kv) * head_dim or not qkv.is_contiguous() or rot_dim > head_dim:
        raise ValueError(f"fused rope_write: qkv {tuple(qkv.shape)} for {n_heads}/{n_kv} heads of {head_dim}")
    if any(t is not None and t.stride(-1) != 1 for t in (cells.keys, cells.values, cells.grouped)):
        raise ValueError("fused rope_write: cells with a strided head dimension")
    q = torch.empty(1, n_heads, 1, head_dim, dtype=qkv.dtype, device=qkv.device)
    q_g = None if grouped is None else torch.empty(q.shape, dtype=torch.float32, device=qkv.device)
    keys_t, queries_t = grouped if grouped is not None else (rotation, rotation)
    store = cells.grouped if grouped is not None and cells.grouped is not None else cells.keys
    qn, kn = norms if norms is not None else (RowNorm(cos, 0.0, False),) * 2
    with on_device(qkv.device):
        rope_write_kernel[(n_heads + n_kv,)](
            qkv, q, q if q_g is None else q_g, cells.keys, cells.values, store, cells.positions, pos,
            cells.slot, cos, sin, queries_t.cos, queries_t.sin, keys_t.cos, keys_t.sin, qn.weight, kn.weight,
            cells.keys.stride(1), cells.keys.stride(2), cells.values.stride(1), cells.values.stride(2),
            store.stride(1), store.stride(2), keys_t.cos.stride(-2) if grouped is not None else 0, qn.eps,
            n_heads, n_kv,
            HEAD_NORM=norms is not None,
            NORM_OFFSET=qn.offset,
            GROUPED=grouped is not None,
            STORE_G=grouped is not None and cells.grouped is not None,
            HEAD_DIM=head_dim,
            ROT_DIM=rot_dim,
            BLOCK_D=pow2(head_dim),
            num_warps=1 if interpreting() else 2,
        )  # fmt: skip
    return q, q_g
