"""One query token's attention over a layer's cells in two Triton kernels (split-K), where it can run.

The decode step's attention in plain tensor ops (``generation.step_attention.attend``) makes float32 copies of
the keys, of both kinds of scores (plain and, with Self-Extend, grouped: every key rotated by its
position's row of a table) and of the probabilities, and reads the cells several times; the step captured
as a CUDA graph runs it over every cell of the buffers, those not in use too. On an 8B shape at 32k cells
that is estimated at 8 ms a token plain and 13 ms with Self-Extend on an H200 (issue 48), most of a 7 ms
budget. :mod:`~selfextend.core.fused_decode_kernel` reads each cell in use once (positions first: the
keys and values of cells not visible are masked lanes, so cells not in use cost their positions only) in
programs over (KV head, run of cells), all query heads of a KV head together as the rows of a matrix
product, then merges the runs by log-sum-exp. Every size comes from tensor shapes and the query's position
is read on the device, so the step stays capturable; the math is ``attend``'s, in float32 (the grouped
query rotated by the same :class:`Rotation` outside; the grouped keys read as the cache stores them, or
rotated by the key table's rows in the kernel).

triton is optional: nothing here imports it until a kernel runs, and :func:`fused_decode_applies` says
no where it is missing. With ``TRITON_INTERPRET=1`` set before triton is imported, the kernels also run
on CPU tensors (Triton's interpreter: slow, for tests). Run on an H200 (``experiments/gpu/runs/``); compiled
for sm_90, sm_89 and sm_80 by ``experiments/gpu/kernel_build.py``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch

from selfextend.core.fused_prefill import (
    DTYPES,
    MAX_HEAD_DIM,
    interpreting,
    kernels_run_on,
    on_device,
    pow2,
)
from selfextend.core.rope import Rotation


class DecodeConfig(NamedTuple):
    """The kernel's tiling: cells per tile, cells per program (a multiple of the tile), warps a program,
    tiles in flight (the loop's pipeline stages)."""

    block_n: int
    split: int
    num_warps: int
    num_stages: int = 3


def fused_decode_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`fused_decode_attention` takes this step: CUDA tensors (or CPU ones under the
    interpreter), dtypes and a head size it takes, triton installed, and not inside ``torch.compile``
    (whose graph fuses ``attend``'s own tensor ops)."""
    if torch.compiler.is_compiling():  # first: nothing below is traced
        return False
    return (
        k.device == q.device
        and v.device == q.device
        and all(x.dtype in DTYPES for x in (q, k, v))
        and q.shape[-1] <= MAX_HEAD_DIM
        and kernels_run_on(q.device)
    )


@lru_cache(maxsize=8)
def _programs(device: torch.device) -> int:
    """How many programs fill the device: four per multiprocessor on CUDA (what one holds at once at the
    default tiles: one wave, no tail; on an H200 at 32k cells with Self-Extend, 32-cell tiles and 512 cells
    a program took 0.053 ms a layer, 64-cell tiles and 1,024 cells (two a multiprocessor) 0.059, 512 0.065:
    experiments/gpu/check_fused_decode.py, run 5), a few under the interpreter."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_config(
    n_cells: int,
    n_kv: int,
    head_dim: int,
    device: torch.device,
    grouped: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> DecodeConfig:
    """Tiles of 32 cells, 16 where Self-Extend rotates keys in the tile (``grouped``) or cells are
    float32; 4 warps, 3 tiles in flight (2 for rotated keys); 256-wide rotated keys one tile at a time with 8
    warps (32 KiB of shared memory: every card takes it). Guesses that compile for sm_90 and
    sm_80 (experiments/gpu/kernel_build.py) without spilling registers but for 256-wide rotated keys (~560
    bytes a thread: the captured step reads stored grouped keys instead, which spill none), timed on an
    H200 for the 8B shape's bf16 head 128 only (experiments/gpu/check_fused_decode.py: 32-cell tiles, 4
    warps, 3 stages the fastest of those tried); runs of cells long enough to fill the device once (at
    least 4 tiles, so a program's setup is paid back)."""
    block_n = 16 if grouped or dtype == torch.float32 else 32
    per_head = -(-n_cells * n_kv // _programs(device))  # cells a program takes to fill the device once
    split = -(-max(per_head, 4 * block_n) // block_n) * block_n
    if grouped and head_dim > 128:
        return DecodeConfig(block_n, split, 8, 1)
    return DecodeConfig(block_n, split, 4, 2 if grouped else 3)


def fused_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int | None,
    q_g: torch.Tensor | None = None,
    keys: Rotation | None = None,
    group_window: int = 0,
    config: DecodeConfig | None = None,
    stored: torch.Tensor | None = None,
    last: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``attend`` in two kernels: q (1, H, 1, D) at ``pos`` (1,) over k and v (1, Hkv, n, D) (any strides;
    query head ``h`` reads KV head ``h // (H / Hkv)``) at ``positions`` (n,) -> (1, 1, H * D).

    A cell at ``j`` is visible iff ``0 <= pos - j`` (``< window`` on a sliding layer). With Self-Extend,
    ``q_g`` (1, H, 1, D) float32 is the query at its grouped position and ``keys`` the table (1, 1, N,
    rot_dim) turning a key cached at ``j`` into one at ``j // G`` (rows past N - 1 clamped, as ``attend``
    does): cells at distance >= ``group_window`` score ``q_g`` against their rotated key, or against
    ``stored`` (1, Hkv, n, D), the cells' keys already at their grouped positions (the cache's, in the
    cells' type): then a grouped cell is read in place of its key, no rotation and no table row. ``last``
    (1,) int64: the cells in use are the first ``last + 1`` (those after it are not read, whatever their
    positions: the static step's buffers), else all ``n``. The output is rounded to ``out_dtype`` (the
    next product's input type) as the merge writes it.
    """
    from selfextend.core.fused_decode_kernel import decode_merge_kernel, decode_partials_kernel

    _, h, _, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if h % hkv or v.shape[1:3] != (hkv, n) or positions.shape != (n,):
        raise ValueError(f"fused decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if stored is not None and (stored.shape != k.shape or stored.dtype != k.dtype):
        raise ValueError(f"fused decode: stored grouped keys {tuple(stored.shape)} for keys {tuple(k.shape)}")
    n_rep = h // hkv
    grouped = q_g is not None and keys is not None
    on_stored = grouped and stored is not None
    cfg = config or default_config(n, hkv, d, q.device, grouped and not on_stored, k.dtype)
    if grouped:
        cos, sin = keys.cos, keys.sin
    else:  # unread (GROUPED off): any tensors of the right rank do
        q_g, cos, sin = q, q[0, :, 0], q[0, :, 0]
    if not on_stored:  # unread (STORED off)
        stored = k
    n_splits = max(1, -(-n // cfg.split))
    acc = torch.empty(h, n_splits, d, device=q.device, dtype=torch.float32)
    m = torch.empty(h, n_splits, device=q.device, dtype=torch.float32)
    l_sum = torch.empty_like(m)
    out = torch.empty(1, 1, h * d, device=q.device, dtype=out_dtype)
    block_d = max(16, pow2(d))
    with on_device(q.device):
        decode_partials_kernel[(hkv, n_splits)](
            q, q_g, k, stored, v, pos, pos if last is None else last, positions, cos, sin, acc, m, l_sum,
            q.stride(1), q.stride(3), q_g.stride(1), q_g.stride(3),
            k.stride(1), k.stride(2), k.stride(3), stored.stride(1), stored.stride(2), stored.stride(3),
            v.stride(1), v.stride(2), v.stride(3),
            positions.stride(0), cos.stride(-2), cos.stride(-1), sin.stride(-2), sin.stride(-1),
            n, n_rep, n_splits, cfg.split, window or 0, group_window, cos.shape[-2], float(scale),
            SLIDING=window is not None,
            LIMITED=last is not None,
            GROUPED=grouped,
            STORED=on_stored,
            LOW=q.dtype == k.dtype == v.dtype and q.dtype != torch.float32,
            UPCAST=interpreting(),
            HEAD_DIM=d,
            ROT_DIM=cos.shape[-1] if grouped else d,
            BLOCK_R=max(4, pow2(n_rep)),
            BLOCK_N=cfg.block_n,
            BLOCK_D=block_d,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
        decode_merge_kernel[(h,)](
            acc, m, l_sum, out, n_splits, HEAD_DIM=d, BLOCK_S=min(16, pow2(n_splits)), BLOCK_D=block_d
        )
    return out
