"""Self-Extend prefill in one fused kernel (Triton), where it can run: CUDA tensors with triton installed.

The two-pass path of :func:`~selfextend.core.attention.self_extend_attention` (a masked neighbor pass,
query block by query block, then a grouped causal pass, merged by log-sum-exp) reads the keys twice and
builds masks; on an H200 it costs 4-5x flash causal attention at 32k tokens. The kernel
(:mod:`~selfextend.core.fused_prefill_kernel`) walks each query block's keys once under one online
softmax: grouped products where every pair is at distance >= W, normal ones inside the window, both only
in the blocks at the window's edge. It takes the grouped queries and keys as tensors (the same ones the
two-pass path builds), so the formulas stay in :mod:`~selfextend.core.positions` and
:mod:`~selfextend.core.rope`.

triton is optional: nothing here imports it until a kernel runs, and :func:`fused_prefill_applies` says
no where it is missing. With ``TRITON_INTERPRET=1`` set before triton is imported, the kernel also runs
on CPU tensors (Triton's interpreter: slow, for tests).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from functools import lru_cache
from typing import NamedTuple

import torch

from selfextend.core.cells import KeyCells
from selfextend.core.rope import Rotation

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


class BlockConfig(NamedTuple):
    """The kernel's tiling: query rows and key slots per block, warps and pipeline stages per program."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether triton can be imported (looked up once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET=1``): kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


HOPPER, AMPERE = 90, 80  # compute capability x 10: H100/H200, A100 (and what the kernels need)
SHARED_KIB = {75: 64, 80: 163, 90: 227, 100: 227}  # a program's shared memory: T4, A100, H100/H200, B200


def shared_kib(arch: int) -> int:
    """KiB of shared memory one program may take on a GPU of compute capability ``arch`` x 10: 99 on the
    others of 8.0 or more (RTX 30/40/50, A10, L4, L40S: 8.6, 8.9, 12.0), whose tiles must be smaller."""
    return SHARED_KIB.get(arch, 99)


def small_shared(arch: int) -> bool:
    """Whether a GPU gives a program less shared memory than an A100 (the 99 KiB cards)."""
    return shared_kib(arch) < shared_kib(AMPERE)


@lru_cache(maxsize=8)
def compute_capability(device: torch.device) -> int:
    """A CUDA device's compute capability x 10 (90: H100/H200, 80: A100, 75: T4); Hopper's for CPU tensors
    (the interpreter's, whose tiles are the defaults' for Hopper)."""
    if device.type != "cuda":
        return HOPPER
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def kernels_run_on(device: torch.device) -> bool:
    """Whether the fused kernels run on ``device``: a CUDA GPU with bfloat16 matrix units (compute
    capability 8.0 or more; on a T4's 7.5 they compile to emulated products spilling kilobytes of registers
    a thread: experiments/gpu/kernel_build.py --arch 75), or the CPU under the interpreter; triton
    installed."""
    if device.type == "cpu":
        return interpreting() and triton_available()
    return device.type == "cuda" and triton_available() and compute_capability(device) >= AMPERE


def pow2(n: int) -> int:
    """The smallest power of two >= n (a Triton tile's sizes are powers of two)."""
    return 1 << max(0, n - 1).bit_length()


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Where a launch's tensors are: their CUDA device made current (Triton launches on the current one),
    nothing for CPU tensors (the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def fused_prefill_applies(q: torch.Tensor, k: torch.Tensor, cells: KeyCells) -> bool:
    """Whether :func:`fused_self_extend_prefill` takes this prefill: gapless keys (slot arithmetic gives
    the distances), a device the kernels run on (:func:`kernels_run_on`), a dtype and head size they take.
    Elsewhere the two-pass path runs."""
    return (
        cells.first is not None
        and k.device == q.device
        and q.dtype in DTYPES
        and k.dtype == q.dtype
        and q.shape[-1] <= MAX_HEAD_DIM
        and kernels_run_on(q.device)
    )


def default_config(
    head_dim: int, dtype: torch.dtype, softcap: bool = False, arch: int = HOPPER
) -> BlockConfig:
    """Tiles for a head size, dtype and GPU (compute capability x 10): the largest of those tried whose
    program compiles without spilling registers (``experiments/gpu/kernel_build.py``, sm_90 and sm_80).
    Hopper's 16-bit tiles at head 128 are the fastest of six ``experiments/gpu/check_fused_prefill.py`` timed
    on an H200 at 32k tokens (18.96 ms, 3 stages 19.52; the others 22.9-34.3); the rest untimed. float32
    (tests, and CUDA float32 models) multiplies in float32 without tensor cores and takes smaller tiles;
    ``softcap`` (Gemma 2) keeps more values live a tile; an A100 or an Ada card (whose matrix products read
    their operands from registers, where Hopper's read shared memory) spills at Hopper's tiles and takes
    smaller ones (head 64: 2 stages; on Hopper 8 warps for every head size up to 128: 4 spilled at head 64);
    the cards with 99 KiB of shared memory a program (8.6, 8.9; 12.0, which spilled 192 bytes at Hopper's
    tiles) spill 8 bytes at the A100's 3 stages and take 2."""
    if dtype == torch.float32:
        if head_dim <= 64:
            return BlockConfig(32, 32, 4, 2)
        return BlockConfig(32, 16, 4, 1) if head_dim <= 128 else BlockConfig(16, 16, 4, 1)
    if head_dim > 128:
        return BlockConfig(64, 16, 8, 2) if softcap else BlockConfig(64, 32, 8, 2)
    small = small_shared(arch)
    if arch < HOPPER or small:
        return BlockConfig(64, 32, 4, 2) if head_dim <= 64 or small else BlockConfig(64, 32, 4, 3)
    return BlockConfig(128, 64, 8, 4)


def fused_self_extend_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_g: torch.Tensor | None,
    k_g: torch.Tensor | None,
    window: int,
    scale: float,
    softcap: float | None = None,
    config: BlockConfig | None = None,
    grouped: tuple[int, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Self-Extend attention for gapless keys, the queries' keys last, in one kernel.

    q (B, H, Lq, D) rotated at the queries' positions, ``q_g`` (B, H, Lq, D) the same queries at their
    grouped positions; k/v (B, Hkv, Lk, D) with Hkv dividing H (query head ``h`` reads KV head
    ``h // (H / Hkv)``, in place), ``k_g`` (B, Hkv, Lk - W, D) the first keys at grouped positions. Query
    row ``r`` sits at key slot ``Lk - Lq + r`` and sees slots up to it: at grouped positions those at
    distance >= ``window``, at their own the rest, under one softmax of the scaled scores (soft-capped by
    ``softcap``, Gemma 2). ``q_g``/``k_g`` None (or no key ever grouped): plain causal attention, exact for
    G = 1. Returns (B, H, Lq, D) in q's dtype.

    ``grouped`` = (first, out, lse): the grouped pairs already attended, by another kernel, for the rows
    from ``first`` on (out (B, H, Lq - first, D), lse (B, H, Lq - first) natural, float32); the kernel then
    walks only the neighbor band, each row's softmax starting from that result (``q_g``/``k_g`` unread).
    """
    from selfextend.core.fused_prefill_kernel import self_extend_prefill_kernel

    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if h % hkv or v.shape[1] != hkv or lk < lq:
        raise ValueError(f"fused prefill: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if grouped is not None:
        first, out_g, lse_g = grouped
        q_g, k_g, n_grouped = q, k, 0
    else:
        first, out_g, lse_g = 0, q, q.new_empty(1, 1, 1, dtype=torch.float32)  # (unread)
        n_grouped = 0 if k_g is None else min(k_g.shape[2], lk - window)
        if q_g is None or k_g is None or n_grouped <= 0:
            q_g, k_g, window, n_grouped = q, k, lk, 0  # every pair a neighbor (no distance reaches lk)
    window = min(window, lk)
    cfg = config or default_config(d, q.dtype, softcap is not None, compute_capability(q.device))
    block_d = max(16, 1 << (d - 1).bit_length())  # tl.dot wants 16 or more, a power of two
    out = torch.empty_like(q)
    grid = (b * h, -(-lq // cfg.block_m))  # heads vary fastest: every head's longest row blocks run first
    with on_device(q.device):
        self_extend_prefill_kernel[grid](
            q, q_g, k, k_g, v, out,
            *q.stride(), *q_g.stride(), *k.stride(), *k_g.stride(), *v.stride(), *out.stride(),
            h, h // hkv, lq, lk, n_grouped, window, float(scale), float(softcap or 0.0),
            out_g, lse_g, first, *out_g.stride(), *lse_g.stride(),
            BAND=grouped is not None,
            SOFTCAP=softcap is not None,
            IEEE=q.dtype == torch.float32,
            UPCAST=interpreting() and q.dtype == torch.bfloat16,
            PAD_D=block_d != d,
            HEAD_DIM=d,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_D=block_d,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
    return out


def fused_rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """:func:`~selfextend.core.rope.rotate` in one kernel where every dimension rotates (else that
    function): ``x`` (B, H, L, D) read once and the result written once, in x's type, where torch's ops
    make four float32 passes. The angles and their cos/sin as ``Rotation.of`` makes them. (On an H200 the
    grouped q/k's making and the host's part took 2.1 ms of a 32k-token layer with torch's ops, 1.8 with
    this kernel: most of it was not the rotation's bytes.)"""
    from selfextend.core.fused_prefill_kernel import rotate_kernel

    rot = Rotation.of(delta, inv_freq.to(x.device))
    b, h, length, d = x.shape
    if rot.cos.shape[-1] != d or d % 2:
        return rot.apply(x)
    cos, sin = rot.cos.contiguous(), rot.sin.contiguous()  # (B or 1, 1, L, D)
    out = torch.empty(b, h, length, d, dtype=x.dtype, device=x.device)
    block_l = max(4, 2048 // d)  # 2,048 elements a program: 16 a thread, none spilled at head 256
    with on_device(x.device):
        rotate_kernel[(b * h, -(-length // block_l))](
            x, cos, sin, out, *x.stride(), cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(2),
            h, length, HALF=d // 2, BLOCK_L=block_l, BLOCK_H=pow2(d // 2), num_warps=4,
        )  # fmt: skip
    return out
