"""Weight-only int8: the layer computes what it says, both kernels agree, and the model stays close."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from torch import nn

from selfextend.generation.generator import Generator
from selfextend.kv.cache import ContextShiftCache
from selfextend.models.quantize import (
    FUSED_MAX_ROWS,
    Int8Linear,
    quantize_int8,
    quantize_rows,
)


def test_quantize_rows_roundtrip_error_is_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(48, 80)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.all((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6)


@pytest.mark.parametrize("rows", [1, 3, FUSED_MAX_ROWS, FUSED_MAX_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_dequantized_product(rows, bias):
    torch.manual_seed(1)
    lin = nn.Linear(64, 96, bias=bias)
    layer = Int8Linear.from_linear(lin)
    x = torch.randn(2, rows, 64)
    want = nn.functional.linear(x.bfloat16(), layer.dequantized()).float()
    if bias:
        want = want + lin.bias
    got = layer(x)
    assert got.dtype == x.dtype and got.shape == (2, rows, 96)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # bfloat16 outputs, summation order
    exact = nn.functional.linear(x, lin.weight, lin.bias)
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()  # and int8 is close to the float layer


def test_fused_and_gemm_paths_agree_on_the_same_rows():
    torch.manual_seed(2)
    layer = Int8Linear.from_linear(nn.Linear(64, 96, bias=False))
    x = torch.randn(FUSED_MAX_ROWS + 4, 64)
    many = layer(x)  # dequantise + GEMM
    few = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])  # fused kernel, row by row
    torch.testing.assert_close(few, many, rtol=1e-2, atol=1e-2)


def test_quantized_model_decodes_like_its_prefill_and_close_to_float():
    model = make_model("llama")
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits[0, -1]
    assert quantize_int8(model) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    gen = Generator(model, ContextShiftCache(model, n_ctx=64))
    gen.feed(ids[0, :30].tolist())
    for t in ids[0, 30:].tolist():
        decoded = gen.feed([t])  # one row at a time: the fused kernel
    with torch.no_grad():
        prefilled = model(ids).logits[0, -1]  # 40 rows: dequantise + GEMM
    assert (decoded - prefilled).abs().max() < 0.02 * prefilled.abs().max()  # bfloat16 rounding only
    assert torch.corrcoef(torch.stack([decoded, want]))[0, 1] > 0.99


def _random_blocks(kind: int, rows: int, columns: int, seed: int = 0):
    """Valid random GGUF blocks of a 4-bit type: random nibbles and 6-bit scales, small float16 d/m."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    halves = 2 if kind != 2 else 1  # d (and m / dmin) at the front of each block
    raw[..., : 2 * halves] = (
        rng.uniform(0.01, 0.1, (rows, columns // block, halves)).astype(np.float16).view(np.uint8)
    )
    if kind == 3:
        raw[..., 2:4] = rng.uniform(-1, 1, (rows, columns // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", [2, 3, 12], ids=["Q4_0", "Q4_1", "Q4_K"])
def test_int4_repacking_matches_gguf_dequantisation(kind):
    """GGUF 4-bit blocks repacked into torch's int4 layout: the values are the gguf package's own
    dequantisation, and the int4 product equals the product with that dequantised tensor (bf16 products)."""
    from gguf import GGMLQuantizationType, quants

    from selfextend.models.quantize import Int4Linear, int4_blocks

    rows, columns = 48, 512
    raw = _random_blocks(kind, rows, columns)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(kind)).reshape(rows, columns)).float()
    q, scale, zero = (torch.from_numpy(a) for a in int4_blocks(kind, raw, columns))
    got = (q - 8) * scale.repeat_interleave(32, dim=1) + zero.repeat_interleave(32, dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    layer = Int4Linear.from_gguf(kind, raw, columns)
    x = torch.randn(3, columns)
    # the kernel's inputs are bfloat16: compare with the same rounding of x, scales and zeros
    s, z = (t.bfloat16().float().repeat_interleave(32, dim=1) for t in (scale, zero))
    ref = x.bfloat16().float() @ ((q - 8) * s + z).T
    torch.testing.assert_close(layer(x), ref, atol=2e-2 * float(ref.abs().max()), rtol=0)
    assert (ref - x @ want.T).abs().max() < 2e-2 * float(ref.abs().max())
