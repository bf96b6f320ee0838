"""The decode step's native attention kernel against the plain math, and the step that calls it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_model
from test_compiled import CACHE_TOLERANCE
from test_decode import TOL, decoded_logits

import selfextend
from selfextend.core.rope import Rotation
from selfextend.generation.decode import DecodeStep
from selfextend.native import decode as native
from selfextend.native.build import ENV, build
from selfextend.native.decode import native_kernels

KERNEL = native_kernels()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler here to build the attention kernel")


def reference(q, k, v, scale, grouped=None) -> torch.Tensor:
    """One softmax over [q_g . k_g, q . k[n_g:]] (grouped keys first) times v, in float64."""
    b, h, _, d = q.shape
    hkv = k.shape[1]
    rows = q.double().reshape(b, hkv, h // hkv, d)  # (B, Hkv, H / Hkv, D)
    n_g = 0 if grouped is None else grouped[1].shape[2]
    scores = rows @ k[..., n_g:, :].double().transpose(-1, -2)
    if grouped is not None:
        q_g = grouped[0].double().reshape(b, hkv, h // hkv, d)
        scores = torch.cat((q_g @ grouped[1].double().transpose(-1, -2), scores), dim=-1)
    probs = torch.softmax(scores * scale, dim=-1)
    return (probs @ v.double()).reshape(b, h, 1, d).float()


def cells(hkv: int, n: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as a cache holds them: views of the first ``n`` of 2n + 5 slots."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, hkv, 2 * n + 5, d, generator=g).to(dtype) for _ in range(2))
    return k[..., :n, :], v[..., :n, :]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 1, 80), (32, 2, 256)])
@pytest.mark.parametrize("n", [1, 63, 1000])
def test_kernel_matches_the_math(dtype, h, hkv, d, n) -> None:
    """Every cell type, grouped-query ratio, head size (80: no specialised copy) and cell count (one cell;
    fewer than a chunk; several chunks) gives softmax(q . k) v to float32 rounding."""
    k, v = cells(hkv, n, d, dtype, seed=n + d)
    q = torch.randn(1, h, 1, d, generator=torch.Generator().manual_seed(1)) * 2
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the cells cut into chunks for two threads, whatever the runner's setting
    try:
        got = KERNEL(q, k, v, d**-0.5)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (1, h, 1, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(q, k, v, d**-0.5), atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_g", [1, 500, 999])
def test_kernel_takes_grouped_keys_first(dtype, n_g) -> None:
    """With Self-Extend's grouped query and keys (in the cells' type), the first n_g scores are q_g . k_g, one
    softmax over all."""
    k, v = cells(3, 1000, 64, dtype, seed=n_g)
    g = torch.Generator().manual_seed(2)
    q, q_g = (torch.randn(1, 9, 1, 64, generator=g) for _ in range(2))
    k_g = torch.randn(1, 3, 1200, 64, generator=g)[..., :n_g, :]  # a view of a longer buffer, as the cache's
    k_g = k_g.to(dtype)  # grouped keys in the cells' type, as the cache keeps them
    got = KERNEL(q, k, v, 0.125, (q_g, k_g))
    torch.testing.assert_close(got, reference(q, k, v, 0.125, (q_g, k_g)), atol=2e-6, rtol=1e-5)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    torch.testing.assert_close(
        KERNEL(q, k, v, 0.125, (q_g, k_g.to(other))),
        reference(q, k, v, 0.125, (q_g, k_g.to(other).to(dtype))),
        atol=2e-6,
        rtol=1e-5,
    )  # grouped keys of another type are read in the cells' type


@needs_kernel
def test_kernel_agrees_with_sdpa_on_large_scores() -> None:
    """Scores in the hundreds (a peaked softmax): no overflow, the same as torch's SDPA."""
    k, v = cells(2, 300, 64, torch.float32, seed=3)
    q = torch.randn(1, 4, 1, 64, generator=torch.Generator().manual_seed(4)) * 40
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(KERNEL(q, k, v, 64**-0.5), want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_refuses_what_it_cannot_read() -> None:
    k, v = cells(2, 10, 64, torch.float32, seed=5)
    q = torch.randn(1, 4, 1, 64)
    assert KERNEL.takes(4, k, v)
    assert not KERNEL.takes(4, k[..., :8], v[..., :8])  # head size not a multiple of 16
    assert not KERNEL.takes(4, k.transpose(-1, -2).contiguous().transpose(-1, -2), v)  # rows not contiguous
    assert not KERNEL.takes(4, k.double(), v.double())
    assert not KERNEL.takes(3, k, v)  # query heads not a multiple of KV heads
    assert not KERNEL.takes(4, torch.cat([k, k]), torch.cat([v, v]))  # two sequences
    with pytest.raises(ValueError, match="cannot read"):
        KERNEL(q[..., :8], k[..., :8], v[..., :8], 1.0)


def test_no_compiler_means_no_kernel(tmp_path, monkeypatch) -> None:
    """A compiler that fails: build() says so in a RuntimeError, the step gets None (SDPA), nothing cached.
    ``SELFEXTEND_NATIVE=0`` gives None too."""
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false does not say"):
        build(tmp_path, native.SOURCE, "native")
    assert list(tmp_path.glob("*.so")) == []
    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path))
    native_kernels.cache_clear()
    try:
        with pytest.warns(UserWarning, match="native decode kernels not built .false does not say"):
            assert native_kernels() is None
        monkeypatch.delenv("CC")
        monkeypatch.setenv(ENV, "0")
        native_kernels.cache_clear()
        assert native_kernels() is None
    finally:
        native_kernels.cache_clear()


@needs_kernel
@pytest.mark.parametrize("cache_type", [None, torch.bfloat16])
@pytest.mark.parametrize("self_extend", [False, True])
def test_step_through_the_kernel_equals_the_forward(monkeypatch, cache_type, self_extend) -> None:
    """The direct step calls the kernel for every layer and token (counted), and its logits through shifts
    are the model's forward's: to 1e-4 over float32 cells, within the cache type's tolerance otherwise."""
    calls = []
    real = native.NativeKernels.__call__
    monkeypatch.setattr(native.NativeKernels, "__call__", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = make_model("llama")
    if self_extend:
        selfextend.apply_self_extend(model, group_size=3, window=12)
    assert isinstance(DecodeStep(model).native, native.NativeKernels)
    ids = torch.randint(3, 97, (70,), generator=torch.Generator().manual_seed(6)).tolist()
    want = decoded_logits(model, ids, direct=False)
    got = decoded_logits(model, ids, direct=True, dtype=cache_type)
    assert len(calls) == 2 * 50  # two layers, 50 tokens
    tolerance = TOL if cache_type is None else CACHE_TOLERANCE[cache_type] * want.abs().max()
    assert (got - want).abs().max() < tolerance
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rot_dim", [64, 32])  # 32: a partial rotary model's first half only
def test_rope_write_rotates_and_stores_the_cell(dtype, rot_dim) -> None:
    """The query rotated as Rotation.apply does; the key rotated and the value as is, rounded to the cache's
    type, in the given slot of every KV head and nowhere else."""
    h, hkv, d, slot = 6, 2, 64, 5
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(1, (h + 2 * hkv) * d, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    rot = Rotation.of(torch.tensor([37]), inv_freq)
    keys, values = (torch.randn(1, hkv, 9, d, generator=g).to(dtype) for _ in range(2))
    before = keys.clone(), values.clone()
    by = Rotation.of(torch.tensor([-29]), inv_freq)  # on to a grouped position
    q, q_g = KERNEL.rope_write(
        qkv,
        (h, hkv),
        (rot.cos.reshape(-1), rot.sin.reshape(-1)),
        keys,
        values,
        slot,
        (by.cos.reshape(-1), by.sin.reshape(-1)),
    )
    rows = qkv.view(1, -1, 1, d)  # (1, H + 2 Hkv, 1, D)
    want_q, want_k = rot.apply(rows[:, : h + hkv]).split((h, hkv), dim=1)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q_g, by.apply(want_q), atol=1e-5, rtol=1e-5)
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(keys[:, :, slot].float(), want_k[:, :, 0], atol=ulp * 4, rtol=ulp)
    assert torch.equal(values[:, :, slot], rows[:, h + hkv :, 0].to(dtype))
    others = [s for s in range(9) if s != slot]
    assert torch.equal(keys[:, :, others], before[0][:, :, others])
    assert torch.equal(values[:, :, others], before[1][:, :, others])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_write_rounds_as_torch_does(dtype) -> None:
    """With nothing to rotate, the stored cells are torch's own rounding of the rows: ties to even, the
    largest values, infinities and NaN included."""
    d = 16
    special = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, 65504.0, 70000.0, float("inf"), -float("inf"), 3e38]
    )
    rows = torch.cat([special, torch.randn(3 * d - len(special) - 1), torch.tensor([float("nan")])]).view(
        1, -1
    )
    keys, values = (torch.zeros(1, 1, 2, d, dtype=dtype) for _ in range(2))
    empty = torch.empty(0)
    assert KERNEL.rope_write(rows, (1, 1), (empty, empty), keys, values, 1)[1] is None
    want = rows.view(3, d).to(dtype)
    assert torch.equal(keys[0, 0, 1].view(torch.int16), want[1].view(torch.int16))
    assert torch.equal(values[0, 0, 1].view(torch.int16)[:-1], want[2].view(torch.int16)[:-1])
    assert values[0, 0, 1, -1].isnan()


def _within_one_bf16_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16 rows equal but where float32 sums in another order put a value on the other side of a
    rounding boundary: then one step apart, and rarely. Values below 1e-30 (subnormal products, which the
    kernels flush to zero) only need to be as small."""
    small = want.float().abs() < 1e-30
    assert (got.float()[small].abs() < 1e-30).all()
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()[~small]
    assert steps.max() <= 1 and (steps == 0).float().mean() > 0.97


@needs_kernel
@pytest.mark.parametrize("n", [576, 64, 17])
def test_rms_norm_bf16_is_the_norm_rounded(n) -> None:
    g = torch.Generator().manual_seed(n)
    x, weight = torch.randn(1, n, generator=g) * 5, torch.randn(n, generator=g)
    got = KERNEL.rms_norm_bf16(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == (1, n)
    _within_one_bf16_step(got, F.rms_norm(x, (n,), weight, 1e-5).bfloat16())
    with pytest.raises(ValueError, match=f"rms_norm_bf16's row reads {n} contiguous float32"):
        KERNEL.rms_norm_bf16(x.double(), weight, 1e-5)


@needs_kernel
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gated_bf16_is_the_activation_rounded(activation) -> None:
    """SwiGLU and GeGLU (Gemma's tanh GELU) over gates from -100 to 100 (e^-g must not overflow either way),
    against the math in float64 and transformers' own activation functions. 1 + tanh(y) cancels for very
    negative gates (to 0 in float64 below y = -19), so the float64 truth is written as the kernel computes it,
    2 sigmoid(2y); transformers' float32 functions agree to 1e-6 absolute."""
    from transformers.activations import ACT2FN

    n = 4096
    gate = torch.cat([torch.linspace(-100, 100, n - 64), torch.linspace(-1e-3, 1e-3, 64)]).bfloat16()
    up = torch.randn(n, generator=torch.Generator().manual_seed(8)).bfloat16()
    gate_up = torch.cat([gate, up]).view(1, -1)
    got = KERNEL.gated_bf16(gate_up, activation)
    assert got.shape == (1, n) and torch.isfinite(got).all()
    g = gate.double()
    s = g if activation == "silu" else 2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)
    _within_one_bf16_step(got[0], (g * torch.sigmoid(s) * up.double()).bfloat16())
    torch.testing.assert_close(
        got[0].float(), ACT2FN[activation](gate.float()) * up.float(), atol=1e-6, rtol=8e-3
    )
    with pytest.raises(ValueError, match="gated_bf16's row reads .* bfloat16"):
        KERNEL.gated_bf16(gate_up.float(), activation)
    with pytest.raises(ValueError, match="not 'relu'"):
        KERNEL.gated_bf16(gate_up, "relu")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_add_adds_the_normed_row(dtype) -> None:
    """Gemma's norm after attention and MLP, added to the residual in place: x + w * y / rms(y)."""
    n = 640
    g = torch.Generator().manual_seed(9)
    x, y, w = (
        torch.randn(1, n, generator=g),
        (torch.randn(1, n, generator=g) * 30).to(dtype),
        torch.randn(n, generator=g),
    )
    want = x + F.rms_norm(y.float(), (n,), w, 1e-6)
    KERNEL.rms_norm_add(x, y, w, 1e-6)
    torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rows of its 640 factors"):
        KERNEL.rms_norm_add(x, y[:, :-1], w, 1e-6)


@needs_kernel
def test_rope_write_norms_each_head_first() -> None:
    """Qwen3's and Gemma 3's q/k norms: each query and key head RMS-normed by its weights, then rotated;
    values untouched by them."""
    h, hkv, d, slot = 4, 1, 256, 3
    g = torch.Generator().manual_seed(10)
    qkv = torch.randn(1, (h + 2 * hkv) * d, generator=g) * 7
    rot = Rotation.of(torch.tensor([1000]), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    norms = native.HeadNorms(torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5, 1e-6)
    keys, values = (torch.zeros(1, hkv, 5, d) for _ in range(2))
    factors = rot.cos.reshape(-1), rot.sin.reshape(-1)
    q, _ = KERNEL.rope_write(qkv, (h, hkv), factors, keys, values, slot, norms=norms)
    rows = qkv.view(1, -1, 1, d)  # (1, H + 2 Hkv, 1, D)
    want_q = rot.apply(F.rms_norm(rows[:, :h], (d,), norms.query, norms.eps))
    want_k = rot.apply(F.rms_norm(rows[:, h : h + hkv], (d,), norms.key, norms.eps))
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(keys[:, :, slot : slot + 1], want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(values[:, :, slot], rows[:, h + hkv :, 0])
    with pytest.raises(ValueError, match="head norms"):
        KERNEL.rope_write(
            qkv, (h, hkv), factors, keys, values, slot, norms=norms._replace(key=norms.key[:-1])
        )


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(300, 576), (64, 40), (5, 1000)])  # K not a multiple of 32: the tail
def test_int8_gemv_is_torchs_int8_product(n, k) -> None:
    """One row against int8 rows with bfloat16 scales: the math of torch's _weight_int8pack_mm (bfloat16 row,
    float sums) to a bfloat16 step. (torch's kernel itself returns garbage for K = 1000 here.)"""
    g = torch.Generator().manual_seed(n)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = (torch.rand(n, generator=g) / 50).bfloat16()
    x = torch.randn(1, k, generator=g)
    got = KERNEL.int8_gemv(x, w, scale)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    want = (x.bfloat16().double() @ w.double().T) * scale.double()
    _within_one_bf16_step(got[0], want[0].bfloat16())
    with pytest.raises(ValueError, match="takes rows of"):
        KERNEL.int8_gemv(torch.randn(1, k + 1), w, scale)


@needs_kernel
@pytest.mark.parametrize("k", [576, 1000])
def test_int8_gemv_takes_rows_together_as_each_alone(k) -> None:
    """Several rows in one call (batched decoding reads an int8 head once for all slots): each row's output
    is bit for bit the one it gets alone."""
    g = torch.Generator().manual_seed(k)
    w = torch.randint(-127, 128, (70, k), dtype=torch.int8, generator=g)
    scale = (torch.rand(70, generator=g) / 50).bfloat16()
    x = torch.randn(6, k, generator=g)  # a group of 4 rows and one of 2
    got = KERNEL.int8_gemv(x, w, scale)
    assert got.shape == (6, 70)
    assert torch.equal(got, torch.cat([KERNEL.int8_gemv(x[i : i + 1], w, scale) for i in range(6)]))


@needs_kernel
def test_gemma3_int8_head_goes_through_the_native_product() -> None:
    """The compiled step's code run eagerly (as ``--compile`` runs its head): an int8 output head is the
    native single-row product (used, counted), its logits the int8 module's to bfloat16 rounding."""
    from conftest import tiny_gemma3

    from selfextend.generation.compiled import FastDecode
    from selfextend.generation.generator import Generator
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models.quantize import quantize_int8

    model = tiny_gemma3(["sliding_attention", "full_attention"], 6)
    quantize_int8(model)
    ids = torch.randint(3, 97, (60,), generator=torch.Generator().manual_seed(10)).tolist()
    runs, calls = [], []
    for native_head in (True, False):
        gen = Generator(model, ContextShiftCache(model, n_ctx=40, n_keep=4), direct_decode=False)
        gen.fast = FastDecode(model, compile=False)
        step = gen.fast.step
        assert step.head_row is not None
        if native_head:
            real = step.head_row
            step.head_row = lambda x, real=real: calls.append(1) or real(x)
        else:
            step.head_row = None
        runs.append(torch.stack([gen.feed(ids[:20])] + [gen.feed([t]) for t in ids[20:]]))
    assert len(calls) >= 30
    assert (runs[0] - runs[1]).abs().max() < 0.02 * runs[1].abs().max()
    assert (runs[0].argmax(-1) == runs[1].argmax(-1)).float().mean() > 0.95
