"""Which of torch's attention kernels a GPU runs for a causal prefill, how fast, and which of them return the
log-sum-exp a second pass can be merged with (the grouped half of Self-Extend is a plain causal attention
of the grouped queries ``q_g[W:]`` over the grouped keys ``k_g[:L-W]``; only the neighbor band needs our
kernel). One layer of the Llama-3.1-8B shape (32 query / 8 KV heads, head 128, bfloat16) at 32k tokens;
each kernel timed alone (median of 5 after a warm-up), with KV heads read in place and repeated.

    PYTHONPATH=. python experiments/gpu/sdpa_probe.py [--length 32768]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, HKV, D = 32, 8, 128


def timed(fn: Callable[[], object]) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sdpa_probe: no CUDA GPU here", file=sys.stderr)
        return 2
    n = args.length
    torch.manual_seed(0)
    q = torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16)
    kr, vr = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    flops = 2 * n * n * D * H  # causal: half of 4 n^2 D a head
    choice = torch.ops.aten._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {n} tokens, sdpa's choice (gqa): "
        f"{SDPBackend(choice).name}"
    )
    cases: dict[str, Callable[[], object]] = {
        "sdpa default gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "sdpa default repeated": lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True),
    }
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):

        def forced(backend=backend, kk=k, vv=v, gqa=True):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)

        cases[f"sdpa {backend.name} gqa"] = forced
        cases[f"sdpa {backend.name} repeated"] = lambda forced=forced: forced(kk=kr, vv=vr, gqa=False)
    aten = torch.ops.aten
    cases["op flash lse gqa"] = lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
    cases["op flash lse repeated"] = lambda: aten._scaled_dot_product_flash_attention(q, kr, vr, 0.0, True)
    cases["op cudnn lse repeated"] = lambda: aten._scaled_dot_product_cudnn_attention(
        q, kr, vr, None, True, 0.0, True
    )
    cases["op cudnn lse gqa"] = lambda: aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True
    )
    cases["op efficient lse repeated"] = lambda: aten._scaled_dot_product_efficient_attention(
        q, kr, vr, None, True, 0.0, True
    )
    lse_check()
    reference = None
    for name, fn in cases.items():
        try:
            ms = timed(fn)
            out = fn()
            o = out[0] if isinstance(out, tuple) else out
            if reference is None:
                reference = o
            err = (o.float() - reference.float()).abs().max().item()
            lse = ""
            if isinstance(out, tuple):
                lse = f", lse {tuple(out[1].shape)} {out[1].dtype}"
            print(f"  {name}: {ms:.2f} ms ({flops / ms / 1e9:.0f} TFLOP/s), max abs vs first {err:.1e}{lse}")
        except Exception as e:  # noqa: BLE001 - each kernel's refusal is a finding
            print(f"  {name}: refused: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        torch.cuda.empty_cache()
    return 0


def lse_check(n: int = 256) -> None:
    """Each op's log-sum-exp against ``logsumexp`` of the scaled causal scores, at ``n`` tokens in float32
    arithmetic: the convention (natural log, scale inside) a merge needs."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    s = (q.float() @ k.float().transpose(-1, -2)) / D**0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    want = torch.logsumexp(s, -1)  # (1, H, n)
    aten = torch.ops.aten
    for name, fn in {
        "flash": lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True),
        "cudnn": lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True),
        "efficient": lambda: aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True),
    }.items():
        try:
            lse = fn()[1].float()
            got = lse.reshape(want.shape) if lse.numel() == want.numel() else lse[..., :n].reshape(want.shape)
            err = (got - want).abs().max()
            print(f"  lse {name}: shape {tuple(lse.shape)}, max abs vs logsumexp {err:.1e}")
        except Exception as e:  # noqa: BLE001
            print(f"  lse {name}: refused: {type(e).__name__}: {str(e).splitlines()[0][:160]}")


if __name__ == "__main__":
    sys.exit(main())
