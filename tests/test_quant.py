"""The native products with GGUF blocks as stored (``native/quant.c`` and each block family's source).

Oracles: ``gguf.quants.dequantize`` of the same bytes. (a) The kernel against a plain float64 reference
of the same math (the weight dequantised, each activation row quantized to int8 per block as llama.cpp's
x86 build makes its Q8_0, Q8_1 and Q8_K blocks, and dequantised): float32 rounding apart. (b) Against the
float product ``x @ dequantize(W)^T``: within the bound the activations' int8 rounding sets (about half a
step per value, times |W|). (c) Batch invariance: each row of a many-row call is bitwise the one-row
call's. Each on the vector path and the portable one, with output sizes and row counts that are not
multiples of anything (of 8 for the 8-row interleaved forms of Q4_0, Q4_1, Q8_0 and the K-quants, which
must hold rows in eights), and on the vector path built without AVX-512 (the K-quants' AVX2 loops, on a
CPU whose default build takes AVX-512 VNNI ones). The reference's activation blocks are checked against
llama.cpp's own: its blocks stored in ``tests/data/``, and its library where llama-cpp-python is
installed.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from selfextend.models.blocks import BLOCK_KINDS, INTERLEAVED, PIECES, base_kind, pack8, unpack8
from selfextend.models.sources import cache_root
from selfextend.native.blocktypes import BLOCK_TYPES
from selfextend.native.build import build
from selfextend.native.quant import SOURCE, QuantKernels, quant_kernels

KERNELS = quant_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler here to build the kernel")
# gguf.quants.quantize writes these; K-quants: random
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16")
# F16 and BF16 rows: their products take float32 activations (blocktypes.py's ACTIVATIONS)
FLOAT_ROWS = {t.code for t in BLOCK_TYPES if t.activations == "f32"}
# whose vector and portable paths take the same float steps (each super-block's integer sum first)
SAME_STEPS = FLOAT_ROWS | {t.code for t in BLOCK_TYPES if t.name in ("IQ4_XS", "Q2_K", "Q3_K")}
N_OUT = 37


def gguf_blocks(
    kind: int, rows: int, columns: int, seed: int = 0, scales: tuple[float, float] = (0.001, 0.02)
) -> np.ndarray:
    """(rows, bytes per row) of type ``kind``: gguf's quantiser on random weights where it has one, else
    random bytes with float16 scales in ``scales`` (a K-quant's d and dmin; Q6_K's and Q3_K's d are last,
    Q2_K's d and dmin)."""
    rng = np.random.default_rng(seed)
    name = BLOCK_KINDS[kind]
    if name in QUANTIZABLE:
        w = rng.standard_normal((rows, columns)).astype(np.float32)
        return quants.quantize(w, GGMLQuantizationType(kind)).view(np.uint8)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    raw = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    at = {"Q6_K": slice(208, 210), "Q3_K": slice(108, 110), "Q2_K": slice(80, 84)}.get(name, slice(0, 4))
    halves = (at.stop - at.start) // 2
    raw[..., at] = rng.uniform(*scales, (rows, columns // block, halves)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def activation_steps(x: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's int8 activation blocks of ``per`` values, made as llama.cpp's x86 build makes its
    Q8_0 / Q8_1 (32) and Q8_K (256) blocks, dequantised (float64); each value's rounding bound; and each
    block of 32's s - d * sum (Q8_1's float16 s against its d times the sum: what Q4_1's and Q5_1's m
    multiply).
    32: q = x * (127 / max|x|) rounded half to even, d = float16(max|x| / 127), s = float16(max|x| / 127 *
    sum q). 256: iscale = -127 / max, max the first value of the largest |x| with its sign, q = min(127,
    iscale * x rounded half to even), d = 1 / iscale (float32 steps throughout). ``per`` 0: the float32
    activations of F16 and BF16 rows, as they are (bound 0)."""
    m, k = x.shape
    if per == 0:
        return x.astype(np.float64), np.zeros_like(x), np.zeros((m, 0))
    xb = x.reshape(m, k // per, per).astype(np.float32)
    if per == 32:
        amax = np.abs(xb).max(axis=-1, keepdims=True)
        d32 = amax / np.float32(127)
        inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
        q = np.rint(xb * inv)
        d = d32.astype(np.float16).astype(np.float64)
        s = (d32 * q.sum(axis=-1, keepdims=True, dtype=np.float32)).astype(np.float16).astype(np.float64)
        offset = (s - d * q.sum(axis=-1, keepdims=True))[..., 0]
        bound = np.abs(d32.astype(np.float64)) / 2 + np.abs(q) * np.abs(d32.astype(np.float64) - d)
    else:
        first = np.take_along_axis(xb, np.abs(xb).argmax(axis=-1)[..., None], axis=-1)
        iscale = np.divide(np.float32(-127), first, out=np.zeros_like(first), where=first != 0)
        q = np.minimum(np.rint(iscale * xb), 127)
        d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0).astype(np.float64)
        offset, bound = np.zeros((m, 0)), np.broadcast_to(np.abs(d) / 2, xb.shape)
    return (q * d).reshape(m, k), bound.reshape(m, k), offset


def block_mins(raw: np.ndarray, kind: int) -> np.ndarray:
    """(rows, blocks) float64: each block's m of Q4_1 or Q5_1 rows (bytes 2-3, float16); no columns for a
    type without one."""
    if BLOCK_KINDS[kind] not in ("Q4_1", "Q5_1"):
        return np.zeros((raw.shape[0], 0))
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    blocks = raw.reshape(raw.shape[0], -1, size)
    return np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float64)


STORED_BLOCKS = Path(__file__).parent / "data" / "activation_blocks.npz"


def _installed_blocks(x: np.ndarray, name: str, per: int, size: int) -> np.ndarray:
    """llama.cpp's quantize_row_<name> of each row of ``x``, from the CPU library llama-cpp-python loads
    (skipped where it is not installed)."""
    import ctypes
    import os

    llama_cpp = pytest.importorskip("llama_cpp")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    quantize = getattr(lib, f"quantize_row_{name}")
    quantize.argtypes, quantize.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    blocks = np.zeros((x.shape[0], x.shape[1] // per, size), np.uint8)
    for row, out in zip(x, blocks, strict=True):
        quantize(np.ascontiguousarray(row).ctypes.data, out.ctypes.data, x.shape[1])
    return blocks


@pytest.mark.parametrize("source", ["stored", "installed"])
@pytest.mark.parametrize(("name", "per", "size"), [("q8_0", 32, 34), ("q8_1", 32, 36), ("q8_K", 256, 292)])
def test_activation_blocks_are_llama_cpps(name: str, per: int, size: int, source: str) -> None:
    """The reference's activation blocks (activation_steps) are llama.cpp's own, bit for bit: its CPU
    library's quantize_row_<name> on rows of every scale, a zero block, a block whose float16 d underflows
    and ties at half a step. "stored": the rows and llama.cpp's blocks kept in ``tests/data/`` (made by
    ``.venv/bin/python experiments/tools/llamacpp_activation_blocks.py build/bin/libggml-cpu.so``, the
    library built from the llama-cpp-python 0.3.36 sdist as that script's docstring says); "installed": the
    same rows through the library of an installed llama-cpp-python."""
    stored = np.load(STORED_BLOCKS)
    x = stored["x"]
    blocks = stored[name] if source == "stored" else _installed_blocks(x, name, per, size)
    assert blocks.shape == (x.shape[0], x.shape[1] // per, size)
    scale = np.float32 if per == 256 else np.float16
    d = np.ascontiguousarray(blocks[..., : np.dtype(scale).itemsize]).view(scale)[..., 0].astype(np.float64)
    q = blocks[..., 4 : 4 + per] if per == 256 else blocks[..., size - 32 :]
    q = q.view(np.int8).astype(np.float64)
    xd, _, offset = activation_steps(x, per)
    assert np.array_equal(xd, (q * d[..., None]).reshape(x.shape))
    if name == "q8_1":
        s = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float64)
        assert np.array_equal(offset, s - d * q.sum(axis=-1))


def per_block(kind: int) -> int:
    """Activation values per int8 block: the K-quants' 256, else 32; 0 for float32 activations."""
    if kind in FLOAT_ROWS:
        return 0
    return 256 if GGML_QUANT_SIZES[GGMLQuantizationType(kind)][0] == 256 else 32


KINDS = sorted(BLOCK_KINDS) + sorted(INTERLEAVED.values())
NAMES = [BLOCK_KINDS.get(k) or BLOCK_KINDS[base_kind(k)] + "x8" for k in KINDS]
PATHS = [False, True]


def columns_of(kind: int) -> int:
    """Values a row in the tests: 3 blocks of 256, 13 of 32, or 427 values (F16, BF16: 26 steps of the 16
    float lanes, a step of 8 into lanes 0-7 and a tail of 3)."""
    if base_kind(kind) in FLOAT_ROWS:
        return 427
    return 256 * 3 if per_block(base_kind(kind)) == 256 else 32 * 13


def kernel_blocks(kind: int, rows: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """(the kernel's blocks of ``kind``, the same rows as the GGUF stores them): ``rows`` of random weights,
    rounded up to eights for an interleaved form."""
    base = base_kind(kind)
    if kind != base:
        rows = -(-rows // 8) * 8
    raw = gguf_blocks(base, rows, columns_of(kind), seed=seed)
    return torch.from_numpy(pack8(raw, base) if kind != base else raw), raw


def test_interleaving_rearranges_the_same_bytes() -> None:
    """pack8 moves each group's 4-bit values (Q8_0, the K-quants: bytes) and scale bytes (the multiset of a
    group's nibbles is kept) and unpack8 undoes it."""
    for base in INTERLEAVED:
        raw = gguf_blocks(base, 24, 5 * per_block(base), seed=base)
        packed = pack8(raw, base)
        assert packed.shape == raw.shape and not np.array_equal(packed, raw)
        assert np.array_equal(unpack8(packed, base), raw)
        if base in PIECES:  # whole bytes moved: each group's bytes are kept as a multiset
            for g in range(3):
                assert np.array_equal(*(np.sort(a[8 * g : 8 * g + 8], axis=None) for a in (packed, raw)))
            continue
        for g in range(3):
            nibbles = [
                np.sort(np.concatenate([a[8 * g : 8 * g + 8] & 15, a[8 * g : 8 * g + 8] >> 4]), axis=None)
                for a in (packed, raw)
            ]
            assert np.array_equal(*nibbles)


@functools.cache
def narrow_kernels() -> QuantKernels:
    """The vector path built without AVX-512 (``-mno-avx512f``): on a CPU with AVX-512 VNNI the K-quants'
    AVX2 loops, which the default build there does not run; elsewhere the default build's code again."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("-mno-avx512f is an x86 flag")
    return QuantKernels(build(cache_root() / "kernels", SOURCE, "quant-narrow", ("-mno-avx512f",)))


@pytest.fixture(scope="module", params=PATHS + ["avx2"], ids=["vector", "portable", "avx2"])
def kernels(request: pytest.FixtureRequest) -> QuantKernels:
    if request.param == "avx2":
        return narrow_kernels()
    return QuantKernels(KERNELS.library, portable=request.param)


@pytest.mark.parametrize("kind", KINDS, ids=NAMES)
@pytest.mark.parametrize("m", [1, 7, 512])
def test_product_is_the_same_math_and_close_to_float(kernels: QuantKernels, kind: int, m: int) -> None:
    columns = columns_of(kind)
    blocks, raw = kernel_blocks(kind, N_OUT, seed=kind)
    w = quants.dequantize(raw, GGMLQuantizationType(base_kind(kind))).astype(np.float64)  # (N, K)
    x = torch.randn(m, columns, generator=torch.Generator().manual_seed(m))
    got = kernels(x, blocks, kind).double().numpy()
    xd, step, offset = activation_steps(x.numpy(), per_block(base_kind(kind)))
    mins = block_mins(raw, base_kind(kind))
    offset = offset if mins.shape[1] else np.zeros((m, 0))
    same_math = xd @ w.T + offset @ mins.T  # Q4_1 and Q5_1: m times Q8_1's s, not d times the sum
    magnitude = np.abs(xd) @ np.abs(w).T
    assert np.all(np.abs(got - same_math) <= 2e-5 * magnitude + 1e-30), kind
    exact = x.double().numpy() @ w.T  # (b): the activations' rounding, about half a step each
    bound = step @ np.abs(w).T + np.abs(offset) @ np.abs(mins).T
    assert np.all(np.abs(got - exact) <= 1.0001 * bound + 2e-5 * magnitude)
    if base_kind(kind) not in FLOAT_ROWS:
        assert np.abs(got - exact).max() > 0  # int8 activations really are rounded


@pytest.mark.parametrize("kind", KINDS, ids=NAMES)
def test_rows_do_not_depend_on_the_batch(kernels: QuantKernels, kind: int) -> None:
    """Every row of a 512-row call (tiles of 4), of a 13-row one (a speculative check: the weight rows read
    once for 3 tiles and a row), of a 7-row one (a tile and a tail of 3) and of a 2-row one (a short tile,
    as a batched step of two slots) equals that row alone, bit for bit, in float32 and rounded to
    bfloat16."""
    columns = columns_of(kind)
    blocks, _ = kernel_blocks(kind, N_OUT, seed=1)
    x = torch.randn(512, columns, generator=torch.Generator().manual_seed(3))
    many = kernels(x, blocks, kind)
    tail, pair = kernels(x[:7], blocks, kind), kernels(x[:2], blocks, kind)
    check = kernels(x[:13], blocks, kind)
    for i in range(512):
        one = kernels(x[i : i + 1], blocks, kind)
        assert torch.equal(many[i : i + 1], one), i
        if i < 13:
            assert torch.equal(check[i : i + 1], one), i
        if i < 7:
            assert torch.equal(tail[i : i + 1], one), i
        if i < 2:
            assert torch.equal(pair[i : i + 1], one), i
    halves = kernels(x[:7].bfloat16(), blocks, kind, out_dtype=torch.bfloat16)
    assert torch.equal(halves[3:4], kernels(x[3:4].bfloat16(), blocks, kind, out_dtype=torch.bfloat16))


def test_vector_and_portable_paths_agree() -> None:
    """The two paths share the integer sums, so they differ only in float32 summation order; over the
    interleaved forms, whose vector lanes are rows, not at all. The interleaved forms give the stored
    rows' products to that order too."""
    vector, portable = QuantKernels(KERNELS.library), QuantKernels(KERNELS.library, portable=True)
    for kind in KINDS:
        blocks, raw = kernel_blocks(kind, N_OUT, seed=5)
        x = torch.randn(9, columns_of(kind))
        a, b = vector(x, blocks, kind), portable(x, blocks, kind)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
        if kind in SAME_STEPS:  # the same float steps on both paths (float.c, iq.c, klow.c)
            assert torch.equal(a, b), kind
        if kind != base_kind(kind):
            assert torch.equal(a, b)
            stored = vector(x, torch.from_numpy(raw), base_kind(kind))
            torch.testing.assert_close(a, stored, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


K_FORMS = [k for k in sorted(INTERLEAVED.values()) if per_block(base_kind(k)) == 256]


@pytest.mark.parametrize("kind", K_FORMS, ids=[BLOCK_KINDS[base_kind(k)] + "x8" for k in K_FORMS])
def test_interleaved_k_quants_are_the_stored_rows_products(kernels: QuantKernels, kind: int) -> None:
    """The K-quants' interleaved forms give the stored rows' products bit for bit where the summation
    order is the same: their vector lanes are rows, each row's integer sums and float steps those of the
    portable path on the stored rows. The stored rows' vector loops sum a super-block in 8 (AVX-512: 16)
    float lanes of one row, so against them only to float32 rounding. Rows in eights, 1 to 9 activation
    rows (each tile shape and a tile with a tail)."""
    stored = QuantKernels(KERNELS.library, portable=True)
    blocks, raw = kernel_blocks(kind, 40, seed=kind)
    for m in (1, 2, 3, 4, 9):
        x = torch.randn(m, columns_of(kind), generator=torch.Generator().manual_seed(m))
        want = stored(x, torch.from_numpy(raw), base_kind(kind))
        assert torch.equal(kernels(x, blocks, kind), want), m
        vector = kernels(x, torch.from_numpy(raw), base_kind(kind))
        torch.testing.assert_close(vector, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("kind", KINDS, ids=NAMES)
def test_looked_up_rows_are_gguf_values(kind: int) -> None:
    """An embedding table's lookup (``rows``), stored or interleaved (row r: lane r % 8 of group r // 8):
    every row, repeats and any order, as gguf dequantises the stored rows, bit for bit in float32."""
    blocks, raw = kernel_blocks(kind, N_OUT, seed=kind)
    ids = torch.cat(
        [torch.randperm(raw.shape[0], generator=torch.Generator().manual_seed(kind)), torch.tensor([3, 3])]
    )
    want = quants.dequantize(raw[ids.numpy()], GGMLQuantizationType(base_kind(kind)))
    assert torch.equal(KERNELS.rows(blocks, kind, columns_of(kind), ids), torch.from_numpy(want))


def test_bad_shapes_are_refused() -> None:
    blocks = torch.from_numpy(gguf_blocks(12, 4, 256))
    with pytest.raises(ValueError, match="do not fit"):
        KERNELS(torch.randn(1, 512), blocks, 12)
    with pytest.raises(ValueError, match="computes GGUF types"):
        KERNELS(torch.randn(1, 256), blocks, 16)
    with pytest.raises(ValueError, match="in eights"):
        KERNELS(torch.randn(1, 32), torch.from_numpy(gguf_blocks(3, 12, 32)), INTERLEAVED[3])


@pytest.mark.parametrize("kind", KINDS, ids=NAMES)
def test_dequantized_tiles_are_gguf_rounded_to_bfloat16(kind: int) -> None:
    """The bf16 engine's weight tiles: each value is gguf's dequantisation of the same bytes, rounded to
    bfloat16 as torch rounds (nearest even), bit for bit."""
    blocks, raw = kernel_blocks(kind, N_OUT, seed=kind)
    want = quants.dequantize(raw, GGMLQuantizationType(base_kind(kind))).astype(np.float32)
    got = KERNELS.dequantize(blocks, kind, columns_of(kind))
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.from_numpy(want).bfloat16())


@pytest.mark.parametrize("kind", KINDS, ids=NAMES)
def test_bf16_engine_is_the_bfloat16_product(kind: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tiled``: x rounded to bfloat16 times the bfloat16 weight, tiles of a few rows (not a divisor of
    the rows) put side by side, within bfloat16's rounding of each output of the float product."""
    import selfextend.native.quant as quant

    monkeypatch.setattr(quant, "TILE_VALUES", 16 * columns_of(kind))  # 16 rows a tile: 3 tiles of 37-40
    blocks, raw = kernel_blocks(kind, N_OUT, seed=kind)
    w = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType(base_kind(kind))).astype(np.float32))
    x = torch.randn(130, columns_of(kind), generator=torch.Generator().manual_seed(2))
    got = KERNELS.tiled(x, blocks, kind)
    same_math = x.bfloat16().double() @ w.bfloat16().double().T
    magnitude = x.abs().double() @ w.abs().double().T
    assert got.dtype == torch.float32 and got.shape == (130, blocks.shape[0])
    assert torch.all((got.double() - same_math).abs() <= 2**-8 * same_math.abs() + 1e-5 * magnitude)
    exact = x.double() @ w.double().T
    assert torch.all((got.double() - exact).abs() <= 2**-8 * (exact.abs() + 2 * magnitude))


def test_layers_take_the_chunk_engine_from_enough_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A BlockLinear multiplies calls of BF16_MIN_ROWS rows or more by its chunk engine and fewer by the
    integer products; set_chunk_engine sets every layer; auto follows the CPU; a bad name is a ValueError."""
    import selfextend.native.quant as quant
    from selfextend.models.blocks import BF16_MIN_ROWS, BlockLinear, set_chunk_engine

    blocks, _ = kernel_blocks(12, N_OUT, seed=4)
    layer = BlockLinear(blocks, 12, columns_of(12))
    model = torch.nn.Sequential(layer)
    x = torch.randn(BF16_MIN_ROWS, columns_of(12))
    assert set_chunk_engine(model, "bf16") == "bf16" == layer.chunk_engine
    with torch.no_grad():
        assert torch.equal(layer(x), KERNELS.tiled(x, blocks, 12))
        assert torch.equal(layer(x[:-1]), KERNELS(x[:-1], blocks, 12))
        set_chunk_engine(model, "int8")
        assert torch.equal(layer(x), KERNELS(x, blocks, 12))
    for amx, engine in ((True, "bf16"), (False, "int8")):
        monkeypatch.setattr(quant, "amx_present", lambda amx=amx: amx)
        assert quant.chunk_engine("auto") == engine == quant.chunk_engine()
    monkeypatch.setenv(quant.ENGINE_ENV, "INT8")
    assert quant.chunk_engine() == "int8" == set_chunk_engine(model, default="bf16")
    assert quant.chunk_engine("bf16") == "bf16"  # a setting before the environment
    monkeypatch.setenv(quant.ENGINE_ENV, "fp8")
    with pytest.raises(ValueError, match="name auto, int8 or bf16"):
        quant.chunk_engine()


def test_amx_tiles_are_used_where_the_cpu_and_os_have_them() -> None:
    """On a CPU with AMX int8 (and Linux 5.16 or later, which grants the tiles' state) the library takes the
    tiles' path for several rows of the 32-value interleaved forms (amx.c; the batch tests above then check it
    bit for bit against one row's loop); elsewhere it says it cannot."""
    import os
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    has = cpuinfo.is_file() and "amx_int8" in cpuinfo.read_text()
    release = tuple(int(p) for p in os.uname().release.split(".")[:2] if p.isdigit())
    if not has or release < (5, 16):
        pytest.skip("no AMX int8 here")
    assert KERNELS.amx
