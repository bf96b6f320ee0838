"""GGUF metadata no model can have, refused by ``info`` and ``generate`` alike in one line naming the file and
the key, before any weight is read (a new user's probe of malformed files: tracebacks, a model run with a NaN
norm epsilon, a shape ``info`` let through, reasons cut off after a colon).

Each file is the tiny Llama GGUF of :func:`test_models.write_tiny_gguf` with a few bytes changed where gguf's
own reader says the field lies (:func:`test_gguf_fuzz._layout`): a key renamed (so the file lacks it), a
value or a tensor's dimension overwritten.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from click.testing import CliRunner
from test_gguf_fuzz import _layout, _put
from test_models import HAS_SMOLLM2, write_tiny_gguf

from selfextend.cli.main import main
from selfextend.hf.facts import ModelError
from selfextend.models.gguf_config import reason

Edit = Callable[[bytes, dict, dict], bytes]


def _rename(key: str, to: str) -> Edit:
    """The key ``key`` renamed to ``to`` (as long), so the file has no ``key``."""
    assert len(key) == len(to)
    return lambda data, keys, tensors: data.replace(key.encode(), to.encode(), 1)


def _value(key: str, value: float | int | str, fmt: str = "<u4") -> Edit:
    """The value of ``key`` overwritten (a string: its bytes, as long as the old ones)."""

    def edit(data: bytes, keys: dict, tensors: dict) -> bytes:
        if isinstance(value, str):
            at = keys[key] + 8  # the string's bytes, after its length
            return data[:at] + value.encode() + data[at + len(value) :]
        return _put(data, keys[key], value, fmt)

    return edit


def _dims(name: str, dims: list[int]) -> Edit:
    def edit(data: bytes, keys: dict, tensors: dict) -> bytes:
        for k, n in enumerate(dims):
            data = _put(data, tensors[name]["dims_at"] + 8 * k, n, "<u8")
        return data

    return edit


CASES = {
    "no architecture": (
        _rename("general.architecture", "general.architecturX"),
        ": its metadata has no general.architecture (which model family it holds)",
    ),
    "architecture bogus": (
        _value("general.architecture", "bogus"),
        " names its architecture 'bogus' (a model family transformers cannot read), but its metadata has no "
        "bogus.* keys (the model's sizes); it has llama.* keys instead",
    ),
    "architecture qwen2": (
        _value("general.architecture", "qwen2"),
        " names its architecture 'qwen2', but its metadata has no qwen2.* keys",
    ),
    "architecture with a space": (
        _value("general.architecture", "gpt2 "),
        " names its architecture 'gpt2 ' (a model family transformers cannot read)",
    ),
    "window past 2^31 - 1": (
        _value("llama.context_length", 2**32 - 1),
        ": llama.context_length is 4294967295, past the longest trained window this reads (2147483647)",
    ),
    "NaN epsilon": (
        _value("llama.attention.layer_norm_rms_epsilon", np.nan, "<f4"),
        ": llama.attention.layer_norm_rms_epsilon is nan, not a finite number",
    ),
    "negative epsilon": (
        _value("llama.attention.layer_norm_rms_epsilon", -1e-5, "<f4"),
        ": llama.attention.layer_norm_rms_epsilon is -1e-05, a negative epsilon",
    ),
    "infinite RoPE base": (
        _value("llama.rope.freq_base", np.inf, "<f4"),
        ": llama.rope.freq_base is inf, not a finite number",
    ),
    "odd RoPE dimension count": (
        _value("llama.rope.dimension_count", 7),
        ": llama.rope.dimension_count is 7, an odd number (RoPE rotates a head's values in pairs)",
    ),
    "zero RoPE dimension count": (
        _value("llama.rope.dimension_count", 0),
        ": llama.rope.dimension_count is 0 (RoPE needs at least one pair of values to rotate)",
    ),
    "RoPE dimension count past the head": (
        _value("llama.rope.dimension_count", 16),
        "rope.dimension_count 16 asks to rotate more values than a head holds (8)",
    ),
    "no heads": (
        _value("llama.attention.head_count", 0),
        ": llama.attention.head_count is 0 (a model needs at least one)",
    ),
    "no KV heads": (
        _value("llama.attention.head_count_kv", 0),
        ": llama.attention.head_count_kv is 0 (a model needs at least one)",
    ),
    "no blocks": (_value("llama.block_count", 0), ": llama.block_count is 0 (a model needs at least one)"),
    "norm of the wrong size": (
        _dims("blk.1.attn_norm.weight", [16]),
        ": tensor blk.1.attn_norm.weight (F32, shape (16,)) is followed by 64 bytes that type and shape "
        "do not account for",  # (a shape of fewer bytes leaves a gap, found before the metadata is read)
    ),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict, dict]:
    path = write_tiny_gguf(tmp_path_factory.mktemp("metadata") / "base.gguf")
    keys, tensors, _ = _layout(path)
    return path.read_bytes(), keys, {t["name"]: t for t in tensors}


def _refusal(args: list[str]) -> str:
    """The one line of a refusal (exit status 2, no traceback), the native kernels' build notice aside."""
    r = CliRunner().invoke(main, args)
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith(("compiling the ", "converting "))]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


@pytest.mark.parametrize("case", CASES)
def test_info_and_generate_refuse_it_alike(case, base, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path / "cache"))
    edit, says = CASES[case]
    path = tmp_path / "edited.gguf"
    path.write_bytes(edit(*base))
    info = _refusal(["info", str(path)])
    generate = _refusal(["generate", "-m", str(path), "-p", "hi", "-n", "4"])
    named = says.startswith((":", " "))  # the walk's refusals start with the file's path
    assert info == generate and info.startswith(f"error: {path}{says}" if named else "error: "), info
    assert says in info, info
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.safetensors"))


@pytest.mark.parametrize(
    "key,renamed,says",
    [
        ("tokenizer.ggml.tokens", "tokenizer.ggml.tokenX", "its metadata has no tokenizer.ggml.tokens"),
        (
            "tokenizer.ggml.merges",
            "tokenizer.ggml.mergeX",
            "its metadata has no tokenizer.ggml.merges, nor tokenizer.ggml.scores to derive them from",
        ),
    ],
)
def test_a_tokenizer_key_the_file_lacks_is_named(key, renamed, says, base, tmp_path, monkeypatch) -> None:
    """A token list or merges missing: the refusal was transformers' bare KeyError ('tokens', 'scores')."""
    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "notokens.gguf"
    path.write_bytes(_rename(key, renamed)(*base))
    line = _refusal(["generate", "-m", str(path), "-p", "hi", "-n", "4"])
    assert line == f"error: cannot read the tokenizer of GGUF '{path}': {says}", line


def test_a_reason_cut_at_a_colon_keeps_its_next_line() -> None:
    """pydantic's validation errors say their reason on the line after a colon: the first line alone was
    "Class validation error for validator 'validate_rope':"."""
    exc = ValueError(
        "Class validation error for validator 'validate_rope':\n    ValueError: RoPE requires X.\n"
    )
    assert reason(exc) == "Class validation error for validator 'validate_rope': ValueError: RoPE requires X."
    assert reason(ValueError("one line\nsecond")) == "one line"


def test_the_fast_reader_reads_what_the_gguf_package_reads(tmp_path) -> None:
    """``GGUFFileReader`` (plain ndarray slices instead of memmap ones, 3x faster on a 49k vocabulary) parses
    every field, part by part, and every tensor's name, type, shape and bytes as ``gguf.GGUFReader`` does:
    on the shipped SmolLM2 file where it is installed, and on a tiny file written here."""
    from gguf import GGUFReader

    from selfextend.models.gguf_reader import GGUFFileReader
    from selfextend.models.sources import DEFAULT_MODEL, resolve_model

    files = [write_tiny_gguf(tmp_path / "tiny.gguf")]
    if HAS_SMOLLM2:
        files.append(resolve_model(DEFAULT_MODEL).gguf_path)
    for path in files:
        theirs, ours = GGUFReader(path), GGUFFileReader(path)
        assert list(theirs.fields) == list(ours.fields) and len(theirs.fields) > 5
        for a, b in zip(theirs.fields.values(), ours.fields.values(), strict=True):
            assert (a.offset, a.types, a.data) == (b.offset, b.types, b.data), a.name
            assert all(np.array_equal(x, y) for x, y in zip(a.parts, b.parts, strict=True)), a.name
        assert len(theirs.tensors) == len(ours.tensors) > 0
        for a, b in zip(theirs.tensors, ours.tensors, strict=True):
            assert (a.name, a.tensor_type, list(a.shape), a.data_offset) == (
                b.name,
                b.tensor_type,
                list(b.shape),
                b.data_offset,
            )
            assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
        assert ours.data.filename == theirs.data.filename  # the tokenizer's conversion finds the file by it


def test_a_value_of_unknown_type_is_named_once(tmp_path) -> None:
    """A flipped byte in a value's type: the key is named, and "metadata key" said once (it was twice)."""
    from selfextend.models.gguf_check import check_table

    path = write_tiny_gguf(tmp_path / "m.gguf")
    keys, _, _ = _layout(path)
    at = keys["general.architecture"] - 4  # the value type, before the value
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_put(path.read_bytes(), at, 4278190088, "<u4"))
    with pytest.raises(
        ModelError, match=r": metadata key general.architecture has an unknown value type \d+$"
    ):
        check_table(bad)
