"""The fused prefill kernel against the reference, case by case, in Triton's interpreter.

Run by tests/test_fused_prefill.py in a subprocess with ``TRITON_INTERPRET=1`` (it must be set before
triton is imported, and the suite's worker has imported it already): prints one JSON line per case, the
largest difference from :func:`self_extend_attention_reference` and the tolerance of its dtype.
"""

from __future__ import annotations

import json
import os

import torch

import selfextend.core.attention as attention
from selfextend.core.attention import self_extend_attention, self_extend_attention_reference
from selfextend.core.decode_query import grouped_keys
from selfextend.core.fused_prefill import BlockConfig, fused_rotate, fused_self_extend_prefill
from selfextend.core.positions import grouped_query_positions
from selfextend.core.rope import rotate

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
SMALL = BlockConfig(16, 16, 4, 1)  # many blocks, so every range of the kernel is walked

# (name, B, H, Hkv, Lq, Lk, D, G, W, dtype, softcap, tiles, through): tiles None = the default ones;
# through "kernel" calls it directly ("strided": on views of (B, L, H, D) tensors), "dispatch" goes through
# self_extend_attention
CASES = [
    ("g2 w8 37", 1, 4, 2, 37, 37, 16, 2, 8, torch.float32, None, SMALL, "kernel"),
    ("g4 w8 chunk 37/60 gqa4/1 softcap", 1, 4, 1, 37, 60, 16, 4, 8, torch.float32, 5.0, SMALL, "kernel"),
    (
        "g4 w20 130 d64",
        1,
        4,
        2,
        130,
        130,
        64,
        4,
        20,
        torch.float32,
        None,
        BlockConfig(32, 16, 4, 1),
        "kernel",
    ),
    ("g4 w20 130 d64 default tiles", 1, 2, 1, 130, 130, 64, 4, 20, torch.float32, None, None, "kernel"),
    ("g1 37", 1, 4, 2, 37, 37, 16, 1, 8, torch.float32, None, SMALL, "kernel"),
    ("w past the length", 1, 4, 2, 37, 37, 16, 4, 64, torch.float32, None, SMALL, "kernel"),
    ("one query row 1/37", 1, 4, 2, 1, 37, 16, 2, 8, torch.float32, None, SMALL, "kernel"),
    ("d128 b2", 2, 2, 2, 37, 37, 128, 4, 8, torch.float32, None, SMALL, "kernel"),
    ("d48 padded", 1, 4, 2, 37, 37, 48, 4, 8, torch.float32, None, SMALL, "kernel"),
    ("bf16 g2 w8 37", 1, 4, 2, 37, 37, 16, 2, 8, torch.bfloat16, None, SMALL, "kernel"),
    ("bf16 g4 w20 130 d64 softcap", 1, 4, 2, 130, 130, 64, 4, 20, torch.bfloat16, 3.0, SMALL, "kernel"),
    ("bf16 chunk 37/100 d64 gqa4/1", 1, 4, 1, 37, 100, 64, 2, 8, torch.bfloat16, None, SMALL, "kernel"),
    ("fp16 g4 w8 37", 1, 4, 2, 37, 37, 16, 4, 8, torch.float16, None, SMALL, "kernel"),
    ("strided views (B, L, H, D) b2", 2, 4, 2, 37, 45, 32, 2, 8, torch.float32, None, SMALL, "strided"),
    ("dispatch g3 w20 90 b2", 2, 4, 2, 90, 90, 16, 3, 20, torch.float32, None, None, "dispatch"),
    ("dispatch chunk 40/90", 1, 4, 2, 40, 90, 64, 4, 16, torch.float32, 4.0, None, "dispatch"),
    ("dispatch bf16 g4 w8 70", 1, 4, 4, 70, 70, 64, 4, 8, torch.bfloat16, None, None, "dispatch"),
    # the grouped pairs through torch's causal kernel first, the kernel walking the band alone (SPLIT_ROWS 1)
    ("split bf16 g4 w8 70", 1, 4, 2, 70, 70, 64, 4, 8, torch.bfloat16, None, SMALL, "split"),
    ("split bf16 chunk 40/90 gqa4/1", 1, 4, 1, 40, 90, 32, 3, 16, torch.bfloat16, None, SMALL, "split"),
    ("split fp16 chunk 20/90 w80 b2", 2, 4, 2, 20, 90, 16, 2, 80, torch.float16, None, SMALL, "split"),
]


def run(case: tuple) -> dict[str, object]:
    """One case: random un-rotated q/k/v, the reference on them, the kernel on them rotated."""
    name, b, h, hkv, lq, lk, d, group, window, dtype, softcap, tiles, through = case
    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    q, k, v = torch.randn(b, h, lq, d), torch.randn(b, hkv, lk, d), torch.randn(b, hkv, lk, d)
    k_pos = torch.arange(lk)[None] + 7 * torch.arange(b)[:, None]  # (B, Lk): each row at its own offset
    q_pos = k_pos[:, lk - lq :]
    scale = d**-0.5
    reference = self_extend_attention_reference(
        q, k, v, q_pos, k_pos, group, window, inv_freq, softcap=softcap
    )
    q_r, k_r, v = rotate(q, q_pos, inv_freq).to(dtype), rotate(k, k_pos, inv_freq).to(dtype), v.to(dtype)
    if through == "strided":  # as transformers hands them: (B, L, H, D) storage seen as (B, H, L, D)
        q_r, k_r, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q_r, k_r, v))
    if through in ("dispatch", "split"):
        attention.SPLIT_ROWS = 1 if through == "split" else 1 << 30
        out = self_extend_attention(q_r, k_r, v, q_pos, group, window, inv_freq, softcap=softcap)
    else:
        n_grouped = lk - window
        q_g = k_g = None
        if n_grouped > 0 and group > 1:
            k_g = grouped_keys(k_r[..., :n_grouped, :], k_pos[:, :n_grouped], group, inv_freq)
            q_g = rotate(q_r, grouped_query_positions(q_pos, group, window) - q_pos, inv_freq)
        out = fused_self_extend_prefill(q_r, k_r, v, q_g, k_g, window, scale, softcap, tiles)
    error = (out.float() - reference.float()).abs().max().item()
    return {"case": name, "dtype": str(dtype), "error": error, "tol": TOL[dtype]}


def low_scores(dtype: torch.dtype, score: float) -> dict[str, object]:
    """Every pair scores ``score`` (q and -q, a rotation of ~0): rows below W in a block across the window's
    edge see nothing in its grouped range first. Their running max was then held at 0, and scores far
    below it underflowed to an empty sum: NaN rows in float16 at -20, float32 at -120."""
    lk, d, window = 40, 16, 8
    inv_freq = torch.full((d // 2,), 1e-9)
    q = torch.full((1, 2, lk, d), (-score / d**0.5) ** 0.5)  # q . k * d**-0.5 = score
    v = torch.randn(1, 1, lk, d, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(lk)[None]
    reference = self_extend_attention_reference(q, -q[:, :1], v, pos, pos, 2, window, inv_freq)
    q, v = q.to(dtype), v.to(dtype)
    out = fused_self_extend_prefill(q, -q[:, :1], v, q, -q[:, :1, : lk - window], window, d**-0.5)
    error = (out.float() - reference.float()).abs().max().item()
    return {"case": f"all scores {score}", "dtype": str(dtype), "error": error, "tol": TOL[dtype]}


def rotate_cases() -> list[dict[str, object]]:
    """:func:`fused_rotate` against :func:`rotate`: float32 and bfloat16, one delta row and one a batch row,
    strided (B, L, H, D) storage, a length off the kernel's 64-row blocks; partial rotary (a fallback)."""
    rows = []
    for name, dtype, b, d, rot_dim, strided in (
        ("rotate f32 b2 strided", torch.float32, 2, 32, 32, True),
        ("rotate bf16 d128", torch.bfloat16, 1, 128, 128, False),
        ("rotate f32 partial rotary", torch.float32, 1, 32, 16, False),
    ):
        torch.manual_seed(2)
        length = 70
        x = torch.randn(b, 3, length, d).to(dtype)
        if strided:
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
        delta = -torch.arange(length)[None] * 3 // 4 - 5 * torch.arange(b)[:, None]  # (B, L)
        error = (fused_rotate(x, delta, inv_freq).float() - rotate(x, delta, inv_freq).float()).abs().max()
        rows.append({"case": name, "dtype": str(dtype), "error": error.item(), "tol": TOL[dtype]})
    return rows


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    calls = []
    fused = attention.fused_self_extend_prefill

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs.get("grouped") is not None)
        return fused(*args, **kwargs)

    attention.fused_self_extend_prefill = counted
    for case in CASES:
        print(json.dumps(run(case)), flush=True)
    for row in rotate_cases():
        print(json.dumps(row), flush=True)
    for dtype, score in ((torch.float16, -20.0), (torch.float32, -120.0)):
        print(json.dumps(low_scores(dtype, score)), flush=True)  # (NaN is written NaN, read back as nan)
    print(json.dumps({"dispatched": len(calls), "split": sum(calls)}))


if __name__ == "__main__":
    main()
