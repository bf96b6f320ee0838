"""A GGUF's embedding table tied to an output head held in an 8-row interleaved form: the table is held once,
its token rows looked up in the head's bytes (``native/rows.c``), with the logits of a table held as stored.

Oracle: the same model with its table swapped for a :class:`BlockEmbedding` of the stored rows (the rows
put back by ``unpack8``: the form tables had before they read the head's), whose lookups
``test_quant.test_looked_up_rows_are_gguf_values`` holds to ``gguf.quants.dequantize``. Tiny tied Llama
GGUFs with 264 tokens (rows in eights): a Q8_0 file (gguf's quantiser) and one with a Q6_K table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_int4 import _teacher_forced
from test_models import write_tiny_gguf
from test_quant import gguf_blocks

import selfextend.models.blocks as blocks_module
from selfextend.generation.decode import DecodeStep
from selfextend.models import load_model
from selfextend.models.blocks import BlockEmbedding, unpack8
from selfextend.models.weights import RunForm, load_run_form, save_run_form
from selfextend.native.blocktypes import INTERLEAVED, base_kind
from selfextend.native.quant import quant_kernels

pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernel")
Q8_0, Q6_K = 8, 14
TABLES = {"Q8_0": {}, "Q6_K": {"Q6_K token_embd": lambda r, c: gguf_blocks(Q6_K, r, c, scales=(2e-5, 1e-4))}}


@pytest.fixture(scope="module", params=sorted(TABLES))
def tied(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    """(the GGUF, its model with ``--weights gguf``): every matrix Q8_0, the table ``request.param``."""
    path = tmp_path_factory.mktemp("tied") / f"tied-{request.param}.gguf"
    write_tiny_gguf(
        path, hidden=256, heads=4, kv_heads=2, quant="Q8_0", blocks=TABLES[request.param], extra_tokens=2
    )
    model, _ = load_model(str(path), weights="gguf")
    return path, model


def stored_table(table: BlockEmbedding) -> BlockEmbedding:
    """The same table held as the GGUF stores its rows (a copy of its own)."""
    raw = table.blocks.numpy()
    raw = torch.from_numpy(unpack8(raw, table.kind) if table.kind in INTERLEAVED.values() else raw.copy())
    return BlockEmbedding(raw, base_kind(table.kind), table.embedding_dim, table.embed_scale, table.dtype)


@contextlib.contextmanager
def swapped(model: torch.nn.Module, table: torch.nn.Module) -> Iterator[None]:
    """``model`` with ``table`` as its embedding for the block."""
    inner, before = model.model, model.model.embed_tokens
    inner.embed_tokens = table
    try:
        yield
    finally:
        inner.embed_tokens = before


def shared(model: torch.nn.Module) -> bool:
    """Whether the table and the head hold one storage, in the head's form: interleaved, or the stored rows
    where the kernels keep them for that type on this CPU (the K-quants' AVX-512 loops)."""
    table, head = model.model.embed_tokens, model.lm_head
    same = table.blocks.untyped_storage().data_ptr() == head.blocks.untyped_storage().data_ptr()
    base = base_kind(table.kind)
    held = INTERLEAVED[base] if quant_kernels().interleaves(base) else base
    return same and table.kind == head.kind == held


def test_the_table_is_held_once_with_the_stored_tables_logits(tied) -> None:
    """The table reads the head's interleaved bytes (one storage); its rows, in float32 and bfloat16 and by
    the reference path (no kernels), are those of the stored table bit for bit; the forward's logits (a
    prompt's rows in one lookup) and the direct decode step's through context shifts are the stored
    table's exactly."""
    _, model = tied
    table = model.model.embed_tokens
    assert isinstance(table, BlockEmbedding) and shared(model)
    stored = stored_table(table)
    every = torch.arange(table.num_embeddings)
    assert torch.equal(table.lookup(every), stored.lookup(every))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blocks_module, "quant_kernels", lambda: None)
        assert torch.equal(table.lookup(every), stored.lookup(every))
    halves = [
        BlockEmbedding(t.blocks, t.kind, t.embedding_dim, dtype=torch.bfloat16) for t in (table, stored)
    ]
    assert torch.equal(halves[0].lookup(every), halves[1].lookup(every))

    ids = torch.randint(3, 264, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = []
    for t in (table, stored):
        with swapped(model, t), torch.no_grad():
            forward = model(torch.tensor([ids])).logits
            stepped, served = _teacher_forced(model, ids, DecodeStep(model))
        assert served >= 30
        runs.append((forward, stepped))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_saved_forms_hold_the_table_once(tied, tmp_path: Path) -> None:
    """A saved run form writes the shared table once and reads back sharing it; one written with the table's
    own stored copy (as before) reads back into one table too; the disk cache's load shares it, with the
    same logits."""
    path, model = tied
    form = RunForm("gguf", torch.float32)
    ids = torch.randint(3, 264, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
    save_run_form(model, tmp_path / "one.safetensors", form)
    with safe_open(str(tmp_path / "one.safetensors"), "pt") as f:
        assert sum(k.endswith("embed_tokens.blocks") or k.endswith("lm_head.blocks") for k in f.keys()) == 1  # noqa: SIM118
    with swapped(model, stored_table(model.model.embed_tokens)):
        save_run_form(model, tmp_path / "two.safetensors", form)
    again, _ = load_model(str(path), weights="gguf")  # from the disk cache
    for name in ("one", "two"):
        back = load_run_form(tmp_path / f"{name}.safetensors", model.config, form)
        for loaded in (back, again):
            assert shared(loaded), name
            with torch.no_grad():
                assert torch.equal(loaded(ids).logits, want), name


# bytes of the tiny tied model but its table, counted by hand: 2 layers of q, o (256 rows), k, v (128),
# gate, up (512) of 256 values and down (256 rows of 512) in Q8_0 (34 bytes per 32 values); 5 float32 norms
# of 256; the rotary's inv_freq and original_inv_freq (32 float32 each); 16 int32 block kinds (7 a layer,
# the table's, the head's)
MATRICES = 2 * ((256 + 128 + 128 + 256 + 512 + 512) * 256 + 256 * 512) // 32 * 34
REST = MATRICES + 5 * 256 * 4 + 2 * 32 * 4 + 16 * 4
TABLE_ROW = {"Q8_0": 256 // 32 * 34, "Q6_K": 210}  # one row of 256 values: 8 Q8_0 blocks, one Q6_K block


def test_a_token_reads_the_tied_table_once(tied) -> None:
    """``bench``'s bytes a decode step reads count the tied table once, as the head's product reads it (it
    had dropped it: the table held in the head's bytes was taken for an untied one; and counted it twice
    where the head keeps a K-quant's stored rows, two tensors over one storage); an untied table counts
    one row. The expected counts are written out by hand (:data:`REST`, 264 rows of :data:`TABLE_ROW`)."""
    from selfextend.bench.speed import bytes_per_token
    from selfextend.kv.cache import ContextShiftCache

    path, model = tied
    row = TABLE_ROW[path.stem.removeprefix("tied-")]
    cache = ContextShiftCache(model, n_ctx=16)
    assert REST == 1_258_816
    assert bytes_per_token(model, cache, 0) == REST + 264 * row
    with swapped(
        model, stored_table(model.model.embed_tokens)
    ):  # the table's own copy: the head reads the other
        assert bytes_per_token(model, cache, 0) == REST + 264 * row + row
