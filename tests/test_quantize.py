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
