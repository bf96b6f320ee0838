"""The decode step's direct products and norms compute exactly what the modules' forwards do."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from test_quantize import _random_blocks
from torch import nn

from selfextend.generation import products
from selfextend.generation.products import norm_of, product_of
from selfextend.models.quantize import Q4_1, Int4Linear, quantize_int8
from selfextend.native.decode import native_kernels


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_products_are_direct_and_equal_the_forward(kind, monkeypatch) -> None:
    if kind == "int4":
        layer = Int4Linear.from_gguf(Q4_1, _random_blocks(Q4_1, 64, 64, seed=1), 64)
    else:
        holder = nn.Sequential(nn.Linear(64, 48, bias=False))
        quantize_int8(holder)
        layer = holder[0]
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    fn = product_of((layer,))
    got = fn(x)
    assert got.dtype == torch.bfloat16  # handed on as the kernel gives it
    assert torch.equal(got.float(), layer.forward(x))
    seen = []
    monkeypatch.setattr(products, "project", lambda *a: seen.append(1))
    product_of((layer,))(x)
    assert not seen  # the kernel itself, not the module's forward
    native = native_kernels()
    if kind == "int8" and native is not None:  # the native single-row product, to bfloat16 rounding
        fast = product_of((layer,), native)(x)
        assert fast.dtype == torch.bfloat16
        torch.testing.assert_close(fast.float(), layer.forward(x), atol=0, rtol=2**-7)


def test_other_layers_go_through_their_forwards() -> None:
    """A float layer, a biased one and several parts side by side: the modules' outputs."""
    torch.manual_seed(0)
    a, b = nn.Linear(64, 32), nn.Linear(64, 16, bias=False)
    x = torch.randn(1, 64)
    assert torch.equal(product_of((a,))(x), a(x))
    assert torch.equal(product_of((a, b))(x), torch.cat([a(x), b(x)], dim=-1))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_rms_norm_is_one_op_equal_to_the_module(family) -> None:
    norm = make_model(family).model.norm
    norm.weight.data.normal_()
    fn = norm_of(norm, torch.float32)
    assert fn is not norm.forward
    x = torch.randn(1, norm.weight.shape[0]) * 3
    assert torch.equal(fn(x), norm(x))
    assert norm_of(norm, torch.bfloat16) == norm.forward  # other dtypes: the module's own rounding
