"""Each block type of the table (``selfextend/native/blocktypes.py``) held as stored by ``load_model(path,
weights="gguf")``, and what a GGUF's other types become.

Oracle: transformers' own GGUF loader (``gguf.quants.dequantize`` of the same bytes) for the weights and
the float model's logits. A tiny Llama GGUF per type, every matrix (the embedding and its tied head among
them) of that type: written by gguf's quantiser where it has one, else random valid blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from test_int4 import PROJECTIONS
from test_models import write_tiny_gguf
from test_quant import FLOAT_ROWS, QUANTIZABLE, gguf_blocks

from selfextend.models import load_model
from selfextend.models.blocks import BlockEmbedding, BlockLinear
from selfextend.native.blocktypes import BLOCK_KINDS, base_kind
from selfextend.native.quant import quant_kernels

PARTS = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernel")


def _maker(kind: int):
    """(rows, columns) -> stored bytes of ``kind``: gguf's quantiser on weights of a model's scale, or random
    blocks with small scales."""
    name = BLOCK_KINDS[kind]

    def make(rows: int, columns: int) -> np.ndarray:
        if name not in QUANTIZABLE:
            return gguf_blocks(kind, rows, columns, seed=rows + columns, scales=(2e-5, 1e-4))
        w = np.random.default_rng(rows + columns).standard_normal((rows, columns)).astype(np.float32)
        return quants.quantize(w * np.float32(0.02), GGMLQuantizationType(kind)).view(np.uint8)

    return make


@pytest.mark.parametrize("kind", sorted(BLOCK_KINDS), ids=[BLOCK_KINDS[k] for k in sorted(BLOCK_KINDS)])
def test_each_type_is_held_as_stored(tmp_path: Path, kind: int) -> None:
    """Every matrix keeps its stored type (an interleaved form of it where the kernels hold one) and bytes
    that dequantise to transformers' weight; the table is a BlockEmbedding of the same type, held once: in
    the tied head's bytes (its interleaved form, rows in eights here), every token's row transformers' bit
    for bit; the logits are the float model's, to the int8 rounding of the activations, and to float32
    rounding for F16 and BF16, whose products take the activations as they are."""
    from transformers import AutoModelForCausalLM

    blocks = {f"{BLOCK_KINDS[kind]} {part}": _maker(kind) for part in PARTS}
    path = write_tiny_gguf(
        tmp_path / "tiny.gguf", hidden=256, heads=4, kv_heads=2, blocks=blocks, extra_tokens=2
    )
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    model, _ = load_model(str(path), weights="gguf")
    for ref_layer, layer in zip(reference.model.layers, model.model.layers, strict=True):
        for name in PROJECTIONS:
            part = "self_attn" if hasattr(layer.self_attn, name) else "mlp"
            module, want = getattr(getattr(layer, part), name), getattr(getattr(ref_layer, part), name).weight
            assert isinstance(module, BlockLinear) and base_kind(module.kind) == kind, name
            torch.testing.assert_close(module.dequantized(), want, atol=0, rtol=0)
    table, head = model.model.embed_tokens, model.lm_head
    assert isinstance(table, BlockEmbedding) and base_kind(table.kind) == kind and table.kind == head.kind
    assert table.blocks.untyped_storage().data_ptr() == head.blocks.untyped_storage().data_ptr()
    vocab = reference.model.embed_tokens.weight.shape[0]
    assert torch.equal(table.lookup(torch.arange(vocab)), reference.model.embed_tokens.weight)
    ids = torch.randint(3, 250, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    if kind in FLOAT_ROWS:
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        return
    assert (got - want).abs().max() <= 0.05 * want.abs().max()  # random K-quant bytes: heavy tails
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.999


def test_other_types_say_what_they_become(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A type the kernels do not compute (TQ2_0 here, as IQ1-IQ3 would) is held as int8, said in one line
    with the bytes: the file's (gguf's block size) and int8's (a byte a weight, a float32 scale a row)."""
    from gguf import GGML_QUANT_SIZES

    from selfextend.models.quantize import Int8Linear

    tq = GGMLQuantizationType.TQ2_0

    def ternary(rows: int, columns: int) -> np.ndarray:
        w = np.random.default_rng(0).standard_normal((rows, columns)).astype(np.float32) * np.float32(0.02)
        return quants.quantize(w, tq)

    path = write_tiny_gguf(tmp_path / "tq.gguf", hidden=256, quant="Q8_0", blocks={"TQ2_0 ffn_down": ternary})
    with caplog.at_level("WARNING", logger="selfextend.models.gguf"):
        model, _ = load_model(str(path), weights="gguf")
    assert all(isinstance(layer.mlp.down_proj, Int8Linear) for layer in model.model.layers)
    rows, columns, (values, size) = 256, 512, GGML_QUANT_SIZES[tq]  # ffn_down: (hidden, 2 hidden), 2 layers
    stored, held = 2 * rows * columns // values * size, 2 * (rows * columns + 4 * rows)
    line = (
        f"2 TQ2_0 matrices ({stored / 1e6:.1f} MB, {8 * size / values:.2f} bits a weight) are held as int8: "
        f"{held / 1e6:.1f} MB, {8 + 32 / columns:.2f} bits a weight"
    )
    assert [r.getMessage() for r in caplog.records if "TQ2_0" in r.getMessage()] == [line]


@pytest.mark.parametrize("kind", sorted(BLOCK_KINDS), ids=[BLOCK_KINDS[k] for k in sorted(BLOCK_KINDS)])
def test_a_nan_in_a_row_makes_its_products_nan(kind: int) -> None:
    """An activation row holding a NaN (a NaN scale in the weights before it puts one there) gives NaN
    products, as torch's float product does, in every path (one row, a tile of rows, an interleaved form);
    llama.cpp's quantizer skips the NaN and the row multiplied as zeros: uniform logits, a perplexity of
    the vocabulary's size where it should have been refused. The other rows keep their numbers."""
    from selfextend.models.blocks import INTERLEAVED, pack8

    kernels = quant_kernels()
    blocks = gguf_blocks(kind, 16, 512, seed=kind, scales=(2e-5, 1e-4))
    forms = [(kind, blocks)]
    if kind in INTERLEAVED and kernels.interleaves(kind):
        forms.append((INTERLEAVED[kind], pack8(blocks, kind)))
    for rows in (1, 3, 16):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        x[0, 100] = float("nan")
        for form, held in forms:
            out = kernels(x, torch.from_numpy(held), form)
            assert out[0].isnan().all(), (form, rows)
            assert torch.isfinite(out[1:]).all(), (form, rows)
