"""The block-type table (``selfextend/native/blocktypes.py``) is the one description of a GGUF block type:
it agrees with gguf's own sizes, the C sources are generated from it and held to it when the library
loads, the build key follows every C source and header, and the products refuse weights of zero size
(which divided by zero in C: SIGFPE, issue 42 item 8)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from selfextend.native.blocktypes import BLOCK_TYPES, BlockType, c_header, c_name, c_sources
from selfextend.native.build import Sources, build, build_key
from selfextend.native.quant import QuantKernels, quant_kernels

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here")


@needs_cc
@pytest.mark.parametrize("t", BLOCK_TYPES, ids=[t.name for t in BLOCK_TYPES])
def test_each_type_is_gguf_s(t: BlockType) -> None:
    """Name, code and block shape are gguf's, and the built library computes the type as gguf reads it:
    rows of that type (gguf's own quantiser where it has one, else random bytes with sane scales) looked
    up exactly as ``gguf.quants.dequantize`` gives them, and their products on the vector and the portable
    path near the float product with those values (so the family's C has the type's loops, whatever its
    comments say)."""
    from test_quant import gguf_blocks

    assert GGMLQuantizationType(t.code).name == t.name
    assert GGML_QUANT_SIZES[GGMLQuantizationType(t.code)] == (t.values, t.nbytes)
    kernels = quant_kernels()
    assert kernels is not None, "the quant library did not build or load (see its warning)"
    raw = gguf_blocks(t.code, 16, 512, seed=t.code)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(t.code)).astype(np.float32))
    blocks = torch.from_numpy(raw)
    assert torch.equal(kernels.rows(blocks, t.code, 512, torch.arange(16)), want)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(t.code))
    for path in (kernels, QuantKernels(kernels.library, portable=True)):
        got, exact = path(x, blocks, t.code), x @ want.T
        assert (got - exact).abs().max() <= 0.02 * exact.abs().max(), (t.name, path.portable)


def test_the_header_is_the_table() -> None:
    header = c_header()
    for t in BLOCK_TYPES:
        assert f"{c_name(t)} = {t.code}" in header
        assert (f"{t.name}X8 = {t.code + 1000}" in header) == t.interleaved


@needs_cc
def test_the_key_follows_every_source_and_header(tmp_path: Path) -> None:
    """Changing any C file of the library, any header beside them, or the generated header changes the key
    (a library built from other code is never loaded)."""
    for f in [*c_sources(), *c_sources()[0].parent.glob("*.h")]:
        shutil.copy(f, tmp_path / f.name)
    files = tuple(tmp_path / f.name for f in c_sources())
    sources = Sources(files, (("blocktypes.h", c_header()),))
    keys = {build_key(CC, sources)}
    for f in sorted(tmp_path.iterdir()):
        text = f.read_text()
        f.write_text(text + "/* changed */\n")
        keys.add(build_key(CC, sources))
        f.write_text(text)
    keys.add(build_key(CC, sources._replace(generated=(("blocktypes.h", c_header() + "\n"),))))
    assert len(keys) == len(list(tmp_path.iterdir())) + 2
    assert build_key(CC, sources) in keys


@needs_cc
def test_a_type_described_without_its_loops_is_refused_at_load(tmp_path: Path) -> None:
    """A table entry whose family's source has no case for it: the library builds, and its load check
    names the type, so the binding never hands it to the C."""
    fake = BlockType("FAKE", 99, 32, 18, "legacy", "q8_32")
    header = c_header((*BLOCK_TYPES, fake))
    library = build(tmp_path, Sources(c_sources(), (("blocktypes.h", header),)), "quant-fake")
    with pytest.raises(RuntimeError, match="no loops for GGUF type 99"):
        QuantKernels(library)


@pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernel")
def test_zero_size_weights_are_refused() -> None:
    """Issue 42 item 8: no weight rows, or rows of no values, are a ValueError, not a crash."""
    kernels = quant_kernels()
    with pytest.raises(ValueError, match="a row and a value or more, not 0x32"):
        kernels(torch.randn(4, 32), torch.zeros(0, 18, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="not 3x0"):
        kernels(torch.randn(4, 0), torch.zeros(3, 0, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="not 0x32"):
        kernels.dequantize(torch.zeros(0, 18, dtype=torch.uint8), 2, 32)
    with pytest.raises(ValueError, match="not 0x256"):
        kernels.tiled(torch.randn(4, 256), torch.zeros(0, 144, dtype=torch.uint8), 12)
