"""Attention that also returns each row's log-sum-exp, the piece Self-Extend's passes are merged by: torch's
fused kernels on the CPU (flash) and on a GPU (cuDNN first, flash, memory-efficient), the portable math
elsewhere or where they refuse (said once), and the exact merge of two results over disjoint keys.
"""

from __future__ import annotations

import warnings

import torch

from selfextend.core.masked import repeat_kv, soft_cap
from selfextend.core.validate import first_line


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    is_causal: bool = False,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns the natural log-sum-exp of each row's scaled scores.

    q (B, H, Lq, D), k/v (B, Hkv, Lk, D) with Hkv dividing H (query head ``h`` reads KV head
    ``h // (H / Hkv)``) -> out (B, H, Lq, D), lse (B, H, Lq) in float32. ``is_causal`` is top-left aligned
    (row r sees keys 0..r); ``mask`` is additive, in q's dtype. On the CPU the fused kernel reads the shared
    KV heads in place (no (B, H, Lk, D) copies of the keys and values); the other paths repeat them.
    ``softcap`` (attention logit soft-capping, Gemma 2), which no fused kernel computes, takes the math.
    """
    if softcap is not None:
        return attend_math(q, k, v, scale, is_causal, mask, softcap=softcap)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        return out, lse
    if q.device.type == "cuda":
        return fused_or_portable(q, k, v, scale, is_causal, mask)
    return attend_math(q, k, v, scale, is_causal, mask)


def fused_or_portable(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    is_causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend`` on a GPU: the fused kernels, or the portable math where they refuse the problem (said once
    per kind of refusal)."""
    try:
        return attend_cuda(q, k, v, scale, is_causal, mask)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:  # a head size, dtype or GPU the fused kernels do not take
        warn_fallback(e)
    return attend_math(q, k, v, scale, is_causal, mask)


_FALLBACK_WARNED: set[str] = set()


def warn_fallback(
    error: RuntimeError, said: str = "fused CUDA attention refused ({}); using the portable kernel"
) -> None:
    """Say once per kind of failure that the fused CUDA kernels were refused and a slower path runs
    instead (``said``, the failure's first line at ``{}``), so a broken GPU path is seen, not silently
    slow."""
    first = first_line(error)
    if first not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(first)
        warnings.warn(said.format(first), stacklevel=3)


def attend_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    is_causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend`` through torch's fused CUDA kernels that return the log-sum-exp.

    cuDNN's attention for half-precision inputs without a mask (KV heads read in place; on an H200 with
    torch 2.11 it is what ``scaled_dot_product_attention`` picks, 610 TFLOP/s at 32k tokens against flash
    attention's 345: ``experiments/gpu/sdpa_probe.py``), flash attention where cuDNN refuses;
    memory-efficient attention (which takes an additive bias and float32) otherwise. Raises RuntimeError
    where none applies, and ``attend`` then falls back to the portable kernel. Causal calls here are
    always square (Lq == Lk), where top-left and bottom-right alignment agree.
    """
    lq, lk = q.shape[-2], k.shape[-2]
    if mask is None and q.dtype in (torch.float16, torch.bfloat16):
        try:
            return cudnn_attend(q, k, v, scale, is_causal)
        except RuntimeError:  # (a cuDNN without attention, a shape it refuses)
            pass
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
    if mask is None and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=scale)[
            :2
        ]
        return out, lse.float()
    bias = None
    if mask is not None:
        # The kernel wants the bias rows 16-element aligned: pad the storage, keep the view Lk wide.
        padded = mask.new_empty(*mask.shape[:-1], -(-lk // 16) * 16)
        padded[..., :lk] = mask
        bias = padded[..., :lk].expand(q.shape[0], q.shape[1], lq, lk)  # (B, H, Lq, Lk)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, is_causal, scale=scale
    )[:2]
    return out, lse[..., :lq].float()  # the kernel pads the lse rows to a multiple of 32


def attend_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    is_causal: bool = False,
    mask: torch.Tensor | None = None,
    chunk: int = 1024,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Portable ``attend``: explicit matmuls over query chunks, so memory stays (chunk, Lk)."""
    lq, lk = q.shape[-2], k.shape[-2]
    k, v = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // v.shape[1])
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for r0 in range(0, lq, chunk):
        r1 = min(r0 + chunk, lq)
        s = torch.matmul(q[..., r0:r1, :].float(), k.float().transpose(-1, -2)) * scale  # (B, H, c, Lk)
        s = soft_cap(s, softcap)
        if mask is not None:
            s = s + mask[..., r0:r1, :].float()
        if is_causal:
            rows = torch.arange(r0, r1, device=q.device)[:, None]
            s = s.masked_fill(torch.arange(lk, device=q.device)[None] > rows, float("-inf"))
        lse[..., r0:r1] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., r0:r1, None])
        out[..., r0:r1, :] = torch.matmul(p, v.float()).to(q.dtype)
    return out, lse


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax merge of two attention results over disjoint key sets, via their log-sum-exp."""
    new_lse = torch.logaddexp(lse, other_lse)
    w_self = torch.exp(lse - new_lse)[..., None]
    w_other = torch.exp(other_lse - new_lse)[..., None]
    merged = out.float() * w_self + other.float() * w_other
    return merged.to(out.dtype), new_lse


def attend_split(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    is_causal: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend`` for the split's grouped pairs: cuDNN's kernel alone on a GPU (raises RuntimeError where
    it refuses: flash attention, at 345 TFLOP/s on an H200, would make the split slower than our one
    kernel), ``attend`` elsewhere (the CPU's fused kernel, under Triton's interpreter: the tests)."""
    if q.device.type != "cuda":
        return attend(q, k, v, scale, is_causal, softcap=softcap)
    return cudnn_attend(q, k, v, scale, is_causal)


def cudnn_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend`` through cuDNN's kernel, KV heads read in place (RuntimeError where it refuses)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, is_causal, scale=scale
    )[:2]
    return out, lse.reshape(q.shape[:-1]).float()  # (B, H, Lq, 1) -> (B, H, Lq)
