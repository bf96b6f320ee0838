"""``selfextend info`` on a GGUF (issue 42 item 16): the metadata parsed once, and the ``gguf`` form's
bytes by block type as loading holds them."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from test_models import write_tiny_gguf

from selfextend.cli.main import main
from selfextend.models import load_config, load_model
from selfextend.models.blocks import BlockEmbedding, BlockLinear
from selfextend.models.gguf import KEPT_BLOCKS, GGUFTable, held_matrices
from selfextend.native.blocktypes import base_kind
from selfextend.native.quant import quant_kernels


def _q4_1(rows: int, columns: int) -> np.ndarray:
    values = np.random.default_rng(1).standard_normal((rows, columns)).astype(np.float32) * 0.02
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q8_0 matrices, the up projections Q4_1; a vocabulary in eights (the tied head's Q8_0 table interleaved,
    and held once)."""
    path = tmp_path_factory.mktemp("info") / "mixed.gguf"
    return write_tiny_gguf(path, quant="Q8_0", blocks={"Q4_1 ffn_up": _q4_1}, extra_tokens=2)


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    parses = []
    original = gguf.GGUFReader.__init__

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        parses.append(args[0] if args else kwargs)
        original(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    return parses


def test_metadata_parsed_once(mixed_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parses = _count_parses(monkeypatch)
    config = load_config(str(mixed_gguf))
    assert config.num_hidden_layers == 2 and len(parses) == 1, parses
    assert gguf.GGUFReader.__name__ == "GGUFReader"  # the name is given back


def test_a_conversion_parses_the_metadata_once(mixed_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    """The check, the config and the tokenizer's conversion read one parse (Gemma 3's vocabulary: 20 s
    each)."""
    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path / "cache"))
    parses = _count_parses(monkeypatch)
    model, tokenizer = load_model(str(mixed_gguf))
    assert len(parses) == 1, parses
    assert len(tokenizer) == model.get_input_embeddings().num_embeddings  # the token list, from that parse


def _loaded_bytes(model: torch.nn.Module) -> dict[int, int]:
    """Bytes of block storage per GGUF type in a loaded model, each storage once (fused layers are views)."""
    seen, by_kind = set(), defaultdict(int)
    for m in model.modules():
        if isinstance(m, BlockLinear | BlockEmbedding):
            storage = m.blocks.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                by_kind[base_kind(m.kind)] += storage.nbytes()
    return dict(by_kind)


@pytest.mark.skipif(quant_kernels() is None, reason="the native products cannot be built here")
def test_held_bytes_are_the_loaded_models(mixed_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path / "cache"))
    held = held_matrices(GGUFTable.read(mixed_gguf), KEPT_BLOCKS["gguf"], torch.float32)
    model, _ = load_model(str(mixed_gguf), weights="gguf")
    assert {int(h.kind): h.held_bytes for h in held} == _loaded_bytes(model)
    assert {int(h.kind) for h in held} == {gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1}

    r = CliRunner().invoke(main, ["info", str(mixed_gguf), "-g", "2", "-w", "64"])
    assert r.exit_code == 0, r.stderr
    form = next(line for line in r.stdout.splitlines() if line.startswith("weights generate uses"))
    assert form.split(None, 3)[-1] == "--weights gguf (auto, on the CPU)", form
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith("  ")}
    assert "2 matrices as stored" in lines["Q4_1"] and "the embedding table" in lines["Q8_0"]


def test_info_names_a_tensor_the_file_lacks(mixed_gguf: Path, tmp_path: Path) -> None:
    """A tensor the metadata asks for and the file lacks (here renamed): ``info`` says so in the file's names,
    as a conversion does (it printed the model as if whole)."""
    renamed = tmp_path / "renamed.gguf"
    renamed.write_bytes(mixed_gguf.read_bytes().replace(b"blk.1.attn_q.weight", b"blk.1.attn_x.weight", 1))
    r = CliRunner().invoke(main, ["info", str(renamed)])
    assert r.exit_code == 2 and "tensor blk.1.attn_q.weight missing" in r.stderr, r.output
    assert CliRunner().invoke(main, ["info", str(mixed_gguf), "-g", "2", "-w", "64"]).exit_code == 0


@pytest.mark.parametrize(
    "key,value,says",
    [
        (
            "llama.feed_forward_length",
            128,
            "blk.0.ffn_gate.weight: shape (64, 32) where the file's metadata says (128, 32)",
        ),
        # the rotation's 8 values, against that head size, are the first contradiction found
        ("llama.attention.key_length", 2**30, "rotates part of a head of 1073741824 values"),
    ],
)
def test_info_refuses_metadata_that_its_matrices_contradict(tmp_path, monkeypatch, key, value, says) -> None:
    """Metadata whose sizes the stored matrices contradict: ``info`` printed the lying sizes (a head size of
    2^30 among them, which ``generate`` then tried to allocate: 550 GB); it now refuses, as a conversion
    does, without reading a weight."""
    real = gguf.GGUFWriter.add_block_count

    def add_block_count(self, n):
        real(self, n)
        self.add_uint32(key, value)

    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", add_block_count)
    if key.endswith("feed_forward_length"):
        monkeypatch.setattr(gguf.GGUFWriter, "add_feed_forward_length", lambda self, n: None)
    path = write_tiny_gguf(tmp_path / "lies.gguf")
    monkeypatch.undo()
    for args in (
        ["info", str(path), "-g", "2", "-w", "64"],
        ["generate", "-m", str(path), "-p", "hi", "-n", "1"],
    ):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2 and says in r.stderr and "converting" not in r.stderr, r.output


def test_a_gguf_without_its_context_length_is_refused(tmp_path, monkeypatch) -> None:
    """No ``llama.context_length``: transformers' default of 2,048 was taken as the trained window, which
    every Self-Extend and shift setting is sized by (llama.cpp refuses the file)."""
    monkeypatch.setattr(gguf.GGUFWriter, "add_context_length", lambda self, n: None)
    path = write_tiny_gguf(tmp_path / "nowindow.gguf")
    monkeypatch.undo()
    r = CliRunner().invoke(main, ["info", str(path)])
    assert r.exit_code == 2 and "its metadata has no llama.context_length" in r.stderr, r.output
