"""The native kernels' wrappers refuse what the C code would misread: a query whose head size is not the
keys', values shaped otherwise than the keys, rotation factors of another type, layout or a size past the
C code's stack rows, norm weights of another type; an empty cache is a ValueError, not a MemoryError.
Each of these went through to the C code before (reading or writing past a buffer, or garbage)."""

from __future__ import annotations

import pytest
import torch

from selfextend.core.rope import Rotation
from selfextend.native.decode import native_kernels

KERNEL = native_kernels()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler here to build the kernels")


def cells(n: int = 10, d: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(1, 2, n, d, generator=g), torch.randn(1, 2, n, d, generator=g)


def test_attention_compares_the_query_and_values_with_the_keys() -> None:
    k, v = cells()
    q = torch.randn(1, 4, 1, 64)
    KERNEL(q, k, v, 0.125)
    with pytest.raises(ValueError, match="cannot read q .1, 4, 1, 32."):
        KERNEL(q[..., :32], k, v, 0.125)  # a head size that is not the keys'
    with pytest.raises(ValueError, match="cannot read"):
        KERNEL(q, k, v[..., :7, :], 0.125)  # fewer values than keys
    with pytest.raises(ValueError, match="cannot read"):
        KERNEL(q, k, v[:, :1], 0.125)  # values of one KV head for keys of two
    with pytest.raises(ValueError, match="cannot read"):
        KERNEL(q, k, v, 0.125, (q[..., :32], k[..., :4, :]))  # a grouped query of another size
    with pytest.raises(ValueError, match="cannot read"):
        KERNEL(q, k, v, 0.125, (q, torch.cat([k, k], dim=2)))  # more grouped keys than cells


def test_an_empty_cache_is_not_out_of_memory() -> None:
    k, v = cells()
    q = torch.randn(1, 4, 1, 64)
    for checked in (False, True):
        with pytest.raises(ValueError, match="no cells to attend"):
            KERNEL(q, k[..., :0, :], v[..., :0, :], 0.125, checked=checked)


def test_rope_write_checks_the_rotation() -> None:
    """(cos, sin) must be float32, contiguous, of one even size of at most the head size: the C code rotates
    ``cos.numel()`` elements of a row of ``d`` on its stack."""
    h, hkv, d = 4, 2, 64
    qkv = torch.randn(1, (h + 2 * hkv) * d)
    keys, values = (torch.zeros(1, hkv, 3, d) for _ in range(2))
    rot = Rotation.of(torch.tensor([5]), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rot.cos.reshape(-1), rot.sin.reshape(-1)
    KERNEL.rope_write(qkv, (h, hkv), (cos, sin), keys, values, 0, (cos, sin))
    wide = torch.cat([cos, cos]), torch.cat([sin, sin])  # 128 factors for heads of 64
    bad = {
        "too wide": wide,
        "float64": (cos.double(), sin.double()),
        "strided": (wide[0][::2], wide[1][::2]),
        "sizes differ": (cos, sin[:32]),
    }
    for pair in bad.values():
        with pytest.raises(ValueError, match="cos, sin"):
            KERNEL.rope_write(qkv, (h, hkv), pair, keys, values, 0)
        with pytest.raises(ValueError, match="cos, sin"):
            KERNEL.rope_write(qkv, (h, hkv), (cos, sin), keys, values, 0, pair)  # the grouped query's
    assert keys.abs().sum() > 0 and (keys[:, :, 1:] == 0).all()  # only the good call wrote


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_norms_check_the_weights_type(dtype) -> None:
    n = 64
    x, y, w = torch.randn(1, n), torch.randn(1, n), torch.randn(n)
    KERNEL.rms_norm_bf16(x, w, 1e-6)
    KERNEL.rms_norm_add(x, y, w, 1e-6)
    with pytest.raises(ValueError, match="factors reads 64 contiguous float32"):
        KERNEL.rms_norm_bf16(x, w.to(dtype), 1e-6)
    with pytest.raises(ValueError, match="factors reads 64 contiguous float32"):
        KERNEL.rms_norm_add(x, y, w.to(dtype), 1e-6)
    with pytest.raises(ValueError, match="factors reads 64 contiguous float32"):
        KERNEL.rms_norm_add(x, y, torch.randn(n, 2)[:, 0], 1e-6)  # strided
