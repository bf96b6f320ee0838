"""The K-quants' 8-row interleaved forms through every tile shape of their vector loops (native/kquant_x8.c:
tiles of up to 4 activation rows for Q4_K and Q5_K, 8 for Q6_K; a batched step of 2-4 slots is one tile).

Oracle: the portable path on the rows as the GGUF stores them (``dot_k``, each row alone), bit for bit: the
interleaved loops' lanes are rows whose integer sums and float steps are the portable path's. Every row
count from 1 to 9 (each tile, a full tile and one row more), 13 and 21 (full tiles and a remainder), on
the default build, its portable path and the build without AVX-512 (the AVX2 loops on a CPU with it).
"""

from __future__ import annotations

import pytest
import torch
from test_quant import K_FORMS, KERNELS, columns_of, kernel_blocks, narrow_kernels

from selfextend.models.blocks import BLOCK_KINDS, base_kind
from selfextend.native.quant import QuantKernels

pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler here to build the kernel")
COUNTS = (*range(1, 10), 13, 21)


@pytest.fixture(scope="module", params=["vector", "portable", "avx2"])
def kernels(request: pytest.FixtureRequest) -> QuantKernels:
    if request.param == "avx2":
        return narrow_kernels()
    return QuantKernels(KERNELS.library, portable=request.param == "portable")


@pytest.mark.parametrize("kind", K_FORMS, ids=[BLOCK_KINDS[base_kind(k)] + "x8" for k in K_FORMS])
def test_every_tile_gives_each_row_alone_and_the_stored_product(kernels: QuantKernels, kind: int) -> None:
    """Each row of a call of m rows, float32 and rounded to bfloat16, is that row's one-row result, and the
    one-row results are the stored rows' portable product, bit for bit."""
    blocks, raw = kernel_blocks(kind, 24, seed=kind)
    x = torch.randn(max(COUNTS), columns_of(kind), generator=torch.Generator().manual_seed(kind))
    alone = torch.cat([kernels(x[i : i + 1], blocks, kind) for i in range(x.shape[0])])
    stored = QuantKernels(KERNELS.library, portable=True)(x, torch.from_numpy(raw), base_kind(kind))
    assert torch.equal(alone, stored)
    for m in COUNTS:
        assert torch.equal(kernels(x[:m], blocks, kind), alone[:m]), m
        halves = kernels(x[:m].bfloat16(), blocks, kind, out_dtype=torch.bfloat16)
        one = kernels(x[m - 1 : m].bfloat16(), blocks, kind, out_dtype=torch.bfloat16)
        assert torch.equal(halves[m - 1 :], one), m
