"""The CUDA attention paths against the portable math on a GPU: run where torch sees one.

The fused kernels (flash / memory-efficient with log-sum-exp, ``attend.attend_cuda``) and Self-Extend's
efficient prefill on CUDA tensors against the full-matrix reference computed on the CPU, in float32 and
bfloat16. Prints the largest differences and exits non-zero past the tolerance (1e-4 for float32, 2e-2 for
bfloat16, the test suite's). ``pytest -k cuda tests/test_self_extend.py`` runs the same kernel check.

    python experiments/quality/cuda_check.py
"""

from __future__ import annotations

import sys

import torch

from selfextend.core import attend
from selfextend.core.attention import self_extend_attention, self_extend_attention_reference
from selfextend.core.rope import rotate


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    print(torch.__version__, torch.cuda.get_device_name())
    worst = 0.0
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 4, 300, 64, device="cuda", dtype=dtype) for _ in range(3))
        mask = torch.zeros(300, 300, device="cuda", dtype=dtype)
        mask.masked_fill_(torch.rand(300, 300, device="cuda") < 0.3, float("-inf")).fill_diagonal_(0.0)
        for kwargs in ({"is_causal": True}, {"mask": mask}, {}):
            fused = attend.attend_cuda(q, k, v, 0.125, **kwargs)
            portable = attend.attend_math(q, k, v, 0.125, chunk=64, **kwargs)
            d_out = (fused[0].float() - portable[0].float()).abs().max().item()
            d_lse = (fused[1].float() - portable[1].float()).abs().max().item()
            print(f"attend_cuda {dtype} {list(kwargs) or ['none']}: out {d_out:.2e}, lse {d_lse:.2e}")
            worst = max(worst, d_out / tol, d_lse / tol)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
        pos = torch.arange(300)[None]
        ref = self_extend_attention_reference(
            q.float().cpu(), k[:, :2].float().cpu(), v[:, :2].float().cpu(), pos, pos, 3, 20, inv_freq
        )
        qr, kr = rotate(q.float().cpu(), pos, inv_freq), rotate(k[:, :2].float().cpu(), pos, inv_freq)
        got = self_extend_attention(
            qr.to("cuda", dtype), kr.to("cuda", dtype), v[:, :2], pos.cuda(), 3, 20, inv_freq.cuda()
        )
        d = (got.float().cpu() - ref).abs().max().item()
        print(f"self_extend_attention {dtype} (CUDA) vs reference (CPU, float32): {d:.2e}")
        worst = max(worst, d / tol)
    print("worst / tolerance:", round(worst, 3))
    return 0 if worst < 1 else 1


if __name__ == "__main__":
    sys.exit(main())
