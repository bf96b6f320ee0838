"""Hostile inputs: every entry point refuses what it cannot use with one clear line, and loses nothing.

Command-line cases assert exit status 2, exactly one ``error:`` line on stderr, no traceback, and every
file that existed before the command byte for byte unchanged. Options refused while the command line is
parsed run as real subprocesses (they never load torch, so each costs a fraction of a second); cases that
get as far as files and models run in-process through click's runner on the tiny model directory (the same
code path, without paying a torch import per case). API cases assert the documented exception type.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from click.testing import CliRunner
from conftest import COMMON, make_model
from server_util import connect, request, serving, side_by_side
from transformers import LlamaConfig, LlamaForCausalLM

from selfextend import apply_self_extend, max_usable_length, remove_self_extend
from selfextend.bench.runner import BenchConfig
from selfextend.cli.main import main
from selfextend.core.validate import ValidationError
from selfextend.evaluation.lengths import check_lengths
from selfextend.evaluation.methods import Method, MethodError, parse_method, parse_methods
from selfextend.evaluation.passkey import passkey_plan
from selfextend.evaluation.results import ResultsError, ResultsWarning, read_jsonl, rejected_path, repair_tail
from selfextend.evaluation.sweep import plan
from selfextend.generation.backends import decode_backends
from selfextend.generation.draft import DraftModel
from selfextend.generation.generator import Generator, run
from selfextend.generation.sampling import SamplingParams
from selfextend.kv.cache import ContextShiftCache
from selfextend.kv.promptcache import PromptCacheError
from selfextend.kv.promptcache import load as load_prompt_cache
from selfextend.models import ModelError, check_gguf, load_config, load_model, resolve_model
from selfextend.models.blocks import TokenIdError
from selfextend.server import slotfiles
from selfextend.server.engine import Engine, Job, Stopped
from selfextend.server.jobs import Reply
from selfextend.server.slots import Slot

ROOT = Path(__file__).resolve().parents[1]


def snapshot(*roots: Path) -> dict[Path, str]:
    """sha256 of every file under ``roots``."""
    out = {}
    for root in roots:
        for p in [root] if root.is_file() else root.rglob("*"):
            if p.is_file():
                out[p] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_one_line_error(code: int, stderr: str, before: dict[Path, str], message: str = "") -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert message.lower() in errors[0].lower(), (message, stderr)
    after = {p: h for p, h in snapshot(*{p.parent for p in before}).items() if p in before}
    assert after == before, "a file that existed before was changed or removed"


# --------------------------------------------------------------------------------------------------
# Options refused at parse time, through a real subprocess (no torch import, ~0.3 s each)
# --------------------------------------------------------------------------------------------------

BIG = "99999999999999999999999"
PARSE_CASES = [
    (["info", "-g", "0"], "--group-size"),
    (["info", "-g", "true"], "integer"),
    (["info", "-g", "4.0"], "integer"),
    (["info", "-w", BIG], "at most"),
    (["info", "-w", "-5"], "--window"),
    (["generate", "-p", "x", "-n", "-2"], "--max-new-tokens"),
    (["generate", "-p", "x", "-n", BIG], "at most"),
    (["generate", "-p", "x", "--ctx", "1"], "--ctx"),
    (["generate", "-p", "x", "--ctx", "abc"], "--ctx"),
    (["generate", "-p", "x", "--keep", "-3"], "--keep"),
    (["generate", "-p", "x", "--temperature", "nan"], "finite"),
    (["generate", "-p", "x", "--temperature", "-1"], "--temperature"),
    (["generate", "-p", "x", "--top-p", "-0.1"], "--top-p"),
    (["generate", "-p", "x", "--top-p", "1.5"], "--top-p"),
    (["generate", "-p", "x", "--top-p", "inf"], "finite"),
    (["generate", "-p", "x", "--temperature", "1e308"], "--temperature"),  # was torch's "probability tensor"
    (["generate", "-p", "x", "--repeat-penalty", "1e-300"], "--repeat-penalty"),
    (["generate", "-p", "x", "-o", "/no-such-folder/o.txt"], "no writable folder"),  # was after the load
    (["chat", "--session", "/no-such-folder/s.pt"], "no writable folder"),
    (["generate", "-p", "x", "--min-p", "1"], "--min-p"),
    (["generate", "-p", "x", "--min-p", "nan"], "finite"),
    (["generate", "-p", "x", "--repeat-penalty", "0"], "--repeat-penalty"),
    (["generate", "-p", "x", "--repeat-penalty", "nan"], "finite"),
    (["generate", "-p", "x", "--repeat-last-n", "-2"], "--repeat-last-n"),
    (["generate", "-p", "x", "--top-k", "-1"], "--top-k"),
    (["generate", "-p", "x", "--seed", "-1"], "--seed"),
    (["generate", "-p", "x", "--seed", str(2**64)], "--seed"),
    (["generate", "-p", "x", "--stats-every", "-1"], "--stats-every"),
    (["generate", "-p", "x", "--threads", "0"], "--threads"),
    (["generate", "-p", "x", "-g", "true", "-w", "16"], "--group-size"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--ctx", "1"], "--ctx"),
    (["bench", "--endless-tokens", "-5"], "--endless-tokens"),
    (["bench", "--reference-max", "-1"], "--reference-max"),
    (["bench", "-g", "0"], "--group-size"),
    (["ppl", "--max-docs", "-1", "-o", "out.jsonl"], "--max-docs"),
    (["ppl", "--max-docs", "0", "-o", "out.jsonl"], "--max-docs"),
    (["passkey", "--trials", "0", "-o", "out.jsonl"], "--trials"),
    (["passkey", "--seed", "-5", "-o", "out.jsonl"], "--seed"),
    (["ppl", "-t", "100000", "-o", "out.jsonl"], "--threads"),  # was a thread pool's panic, then a segfault
    (["ppl", "--lengths", "3", "-o", "out.jsonl"], "--lengths"),  # a last quarter of no token: NaN records
    (["bench", "--cases", ""], "--cases"),
    (["generate", "--draft-max", "5", "-p", "hi"], "--draft-max needs --draft-model"),
    (["ppl", "--dataset", "", "-o", "out.jsonl"], "names no dataset"),
    (
        ["plot", "results.jsonl", "-o", "results.jsonl/x.png"],
        "results.jsonl is not a folder",
    ),
    (["plot", "results.jsonl", "--trained-window", "0"], "--trained-window"),
    (["table", "results.jsonl", "--reference", "-4"], "--reference"),
]


@pytest.mark.parametrize("args,message", PARSE_CASES, ids=[" ".join(a) for a, _ in PARSE_CASES])
def test_parse_time_refusals_subprocess(args, message, tmp_path):
    (tmp_path / "results.jsonl").write_text('{"model": "m", "doc": "d", "method": "plain", "length": 2}\n')
    (tmp_path / "out.jsonl").write_text('{"kept": true}\n')
    before = snapshot(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "selfextend", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert_one_line_error(r.returncode, r.stderr, before, message)


# --------------------------------------------------------------------------------------------------
# Values refused before any model loads (lengths, methods, depths), in-process
# --------------------------------------------------------------------------------------------------

METHOD_CASES = [
    (["ppl", "--lengths", "infk"], "is not a length"),
    (["ppl", "--lengths", "nank"], "is not a length"),
    (["ppl", "--lengths", "1"], "--lengths"),
    (["ppl", "--lengths", "0.001k"], "is 1.024 tokens: a length is at least 4"),
    (["ppl", "--lengths", "1e30"], "is not a length"),
    (["ppl", "--lengths", "0.5"], "is 0.5 tokens"),
    (["ppl", "--lengths", ","], "at least one"),
    (["ppl", "--method", "ntk:factor=nan"], "finite"),
    (["ppl", "--method", "yarn:factor=inf"], "finite"),
    (["ppl", "--method", "ntk:factor=1"], "> 1"),
    (["ppl", "--method", "selfextend:G=true,W=8"], "integer"),
    (["ppl", "--method", "selfextend:G=4.5,W=8"], "integer"),
    (["ppl", "--method", "selfextend:G=4,G=8,W=8"], "twice"),
    (["ppl", "--method", "selfextend:G=4,W=8", "--method", "selfextend:W=8,G=4"], "twice"),
    (["ppl", "--method", "plain", "--method", "PLAIN"], "twice"),
    (["ppl", "--method", "shift:ctx=1"], "ctx"),
    (["ppl", "--method", "shift:ctx=10,keep=9"], "keep"),
    (["ppl", "--method", "shift:ctx=10,keep=-1"], "keep"),
    (["ppl", "--method", "shift:ctx=2048,G=4"], "both G and W"),
    (["ppl", "--method", "magic"], "unknown method"),
    (["passkey", "--depths", "nan"], "--depths"),
    (["passkey", "--depths", "1.5"], "--depths"),
    (["passkey", "--depths", "a,b"], "--depths"),
    (["passkey", "--depths", ""], "names no depth"),  # was "must lie in [0, 1]"
    (["ppl", "--corpus", ""], "--corpus"),  # read the current folder's files
    (["ppl", "-o", "/proc/nonexistent/r.jsonl"], "cannot create"),  # after the first point, lost
    (["passkey", "-o", "/proc/version"], "cannot append to /proc/version"),  # root passes os.access: lost
    # found when the session ended, the conversation unsaved (a read-only file had been replaced)
    (["chat", "--session", "/proc/version"], "/proc/version: the file is read-only"),
    (["chat", "--session", "new/"], "a file's name is needed, not a folder's"),  # saved as the file "new"
    (["passkey", "--lengths", "-2k"], "--lengths"),
    (["bench", "--lengths", "infk"], "--lengths"),
    (["bench", "--cases", "nope"], "--cases"),
    # refused before the model is even looked for (a probe waited 6-13 s for these, torch imported first)
    (["bench", "-m", "no/such/model", "--forms", "foo"], "--forms"),
    (["bench", "-m", "no/such/model", "--decode-lengths", "nan"], "--decode-lengths (nan) is not a length"),
    (["ppl", "-m", "no/such/model", "--lengths", "abc"], "--lengths (abc) is not a length"),
    (["passkey", "-m", "no/such/model", "--lengths", "abc"], "--lengths (abc) is not a length"),
    (["ppl", "-m", "no/such/model", "--method", "ntk:factor=1"], "must be a finite number > 1"),
]


def invoke(args: list, cwd: Path) -> tuple[int, str]:
    old = Path.cwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(main, [str(a) for a in args])
    finally:
        os.chdir(old)
    assert isinstance(r.exception, SystemExit), r.exception  # no exception escaped the command
    return r.exit_code, r.stderr


@pytest.mark.parametrize("args,message", METHOD_CASES, ids=[" ".join(a) for a, _ in METHOD_CASES])
def test_values_refused_before_loading(args, message, tmp_path):
    (tmp_path / "out.jsonl").write_text('{"kept": true}\n')
    before = snapshot(tmp_path)
    if args[0] in ("ppl", "passkey") and "-o" not in args:
        args = [*args, "-o", "out.jsonl"]
    code, stderr = invoke(args, tmp_path)
    assert_one_line_error(code, stderr, before, message)


# --------------------------------------------------------------------------------------------------
# Files: models, texts, prompt caches, results
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_gguf() -> Path:
    return resolve_model("smollm2-135m").gguf_path


@pytest.fixture()
def files(tmp_path, tiny_dir, real_gguf, monkeypatch) -> Path:
    """A folder of bad files, and a private converted-model cache (nothing may be written to the user's)."""
    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "in"
    d.mkdir()
    data = real_gguf.read_bytes()
    (d / "header.gguf").write_bytes(data[:100])
    (d / "tensor_table.gguf").write_bytes(data[:50_000])
    (d / "empty.gguf").write_bytes(b"")
    (d / "text.gguf").write_text("not a model\n")
    for name, config in {
        "badjson": "{not json",
        "list": "[1, 2]",
        "notype": '{"hidden_size": 8}',
        "latin1": '{"model_type": "llama", "x": "\xe9"}',
        "zeroheads": '{"model_type": "llama", "num_attention_heads": 0}',  # transformers divides by it
        "minuslayers": '{"model_type": "llama", "num_hidden_layers": -1}',
        "theta": '{"model_type": "llama", "rope_theta": "abc"}',
        "kvheads": '{"model_type": "llama", "num_key_value_heads": 3}',
        # a NaN or negative scaling factor ran (transformers only warns), an unknown type was a KeyError
        "factornan": '{"model_type": "llama", "rope_parameters": {"rope_type": "linear", "factor": NaN}}',
        "factorneg": '{"model_type": "llama", "rope_parameters": {"rope_type": "linear", "factor": -4.0}}',
        "ropefoo": '{"model_type": "llama", "rope_parameters": {"rope_type": "foo", "factor": 2.0}}',
        "yarn0": '{"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0, '
        '"original_max_position_embeddings": 0}}',
    }.items():
        (d / name).mkdir()
        (d / name / "config.json").write_bytes(
            config.encode("latin-1") if name == "latin1" else config.encode()
        )
    (d / "noconfig").mkdir()
    for name, template in {
        "brokentemplate": "{% for m in messages %}{{ m.content ",
        "raising": "{{ raise_exception('x') }}",
    }.items():
        (d / name).mkdir()  # the tiny model with a chat template that cannot render: was a jinja traceback
        for f in tiny_dir.iterdir():
            (d / name / f.name).write_bytes(f.read_bytes())
        (d / name / "chat_template.jinja").write_text(template)
    (d / "morelayers").mkdir()  # a config with a layer its weights lack: it ran with that layer random
    for f in tiny_dir.iterdir():
        (d / "morelayers" / f.name).write_bytes(f.read_bytes())
    config = json.loads((tiny_dir / "config.json").read_text())
    (d / "morelayers" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    (d / "widerffn").mkdir()  # weights of other shapes than the config's: "look at the above report" (none)
    for f in tiny_dir.iterdir():
        (d / "widerffn" / f.name).write_bytes(f.read_bytes())
    (d / "widerffn" / "config.json").write_text(
        json.dumps({**config, "intermediate_size": config["intermediate_size"] + 16})
    )
    noweights = d / "noweights"
    noweights.mkdir()
    for f in tiny_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            (noweights / f.name).write_bytes(f.read_bytes())
    cut = d / "cutweights"
    cut.mkdir()
    for f in tiny_dir.iterdir():
        raw = f.read_bytes()
        (cut / f.name).write_bytes(raw[: len(raw) // 2] if f.name.endswith(".safetensors") else raw)
    notok = d / "notokenizer"
    notok.mkdir()
    for f in tiny_dir.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (notok / f.name).write_bytes(f.read_bytes())
    (d / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    (d / "empty.txt").write_text("  \n")
    (d / "emptydir").mkdir()
    (d / "out.jsonl").write_text('{"kept": true}\n')
    (d / "notes.txt").write_text("my precious notes\nline two\n")
    return d


FILE_CASES = [
    (["info", "{in}/header.gguf"], "truncated or corrupted"),
    (["info", "{in}/empty.gguf"], "not a GGUF"),
    (["info", "{in}/text.gguf"], "not a GGUF"),
    (["generate", "-m", "{in}/tensor_table.gguf", "-p", "x"], "truncated"),
    (["ppl", "-m", "{in}/header.gguf", "--lengths", "64", "-o", "{in}/out.jsonl"], "truncated"),
    (["bench", "-m", "{in}/text.gguf", "--lengths", "64"], "not a GGUF"),
    (["info", "{in}/missing.gguf"], "no such file"),
    (["info", "{in}/badjson"], "not valid JSON"),
    (["info", "{in}/list"], "not a JSON object"),
    (["info", "{in}/notype"], "model_type"),
    (["info", "{in}/latin1"], "not UTF-8"),
    (["info", "{in}/noconfig"], "no config.json"),
    (["info", "{in}/zeroheads"], "num_attention_heads is 0"),  # was "integer division or modulo by zero"
    (["info", "{in}/minuslayers"], "num_hidden_layers is -1"),  # was printed: "layers -1"
    (["info", "{in}/theta"], "rope_theta is 'abc'"),
    (["info", "{in}/kvheads"], "3 KV heads do not divide"),
    (["info", "{in}/factornan"], "RoPE scaling factor is nan, not a number >= 1"),
    (["info", "{in}/factorneg"], "RoPE scaling factor is -4.0, not a number >= 1"),
    (["info", "{in}/ropefoo"], "RoPE scaling type 'foo' is not one transformers knows"),
    (["info", "{in}/yarn0"], "original_max_position_embeddings is 0, not >= 1"),
    (["generate", "-m", "{in}/brokentemplate", "-p", "x"], "the model's chat template failed: "),
    (["generate", "-m", "{in}/raising", "-p", "x"], "the model's chat template failed: x"),
    (["chat", "-m", "{in}/raising"], "the model's chat template failed: x"),
    (["generate", "-m", "{in}/morelayers", "-p", "x"], "lack 9 tensors its config.json asks for"),
    (["generate", "-m", "{in}/noweights", "-p", "x"], "cannot load"),
    (["generate", "-m", "{in}/widerffn", "-p", "x"], "mlp.down_proj.weight of shape ("),
    (["generate", "-m", "{in}/cutweights", "-p", "x"], ".safetensors weights file is truncated or corrupted"),
    # it ended at "Couldn't instantiate the backend tokenizer from one of:"
    (["generate", "-m", "{in}/notokenizer", "-p", "x"], "no tokenizer it can read (tokenizer.json, or"),
    (["generate", "-m", "{tiny}", "-f", "{in}/latin1.txt"], "not UTF-8"),
    (["generate", "-m", "{tiny}", "-f", "{in}/empty.txt"], "empty"),
    (["generate", "-m", "{tiny}", "-f", "{in}/missing.txt"], "cannot read"),
    (["generate", "-m", "{tiny}", "--system-file", "{in}/latin1.txt", "-p", "x"], "not UTF-8"),
    (["ppl", "-m", "{tiny}", "--corpus", "{in}/latin1.txt", "-o", "{in}/out.jsonl"], "not UTF-8"),
    (["ppl", "-m", "{tiny}", "--corpus", "{in}/emptydir", "-o", "{in}/out.jsonl"], "no .txt files"),
    (["ppl", "-m", "{tiny}", "--docs", "nosuch", "-o", "{in}/out.jsonl"], "no document named"),
    (["ppl", "-m", "{tiny}", "--docs", " , ", "-o", "{in}/out.jsonl"], "names no document"),
    # a text file named as the results: was rewritten without its lines (moved to notes.txt.rejected)
    (
        ["ppl", "-m", "{tiny}", "--lengths", "64", "--max-docs", "1", "-o", "{in}/notes.txt"],
        "holds no results",
    ),
    (
        ["passkey", "-m", "{tiny}", "--lengths", "256", "--trials", "1", "-o", "{in}/notes.txt"],
        "holds no results",
    ),
    # shorter than the task and question: the record said "length": 16 of a prompt of ~90 tokens
    (
        ["passkey", "-m", "{tiny}", "--lengths", "16", "--trials", "1", "-o", "{in}/pk.jsonl"],
        "must be at least",
    ),
    (["generate", "-m", "{tiny}", "-p", "x", "--draft-model", "{in}/missing.gguf"], "--draft-model"),
    (["generate", "-m", "{tiny}", "-p", "x", "-g", "2", "-w", "256"], "trained window"),
    (["generate", "-m", "{tiny}", "-p", "x", "--ctx", "8", "--keep", "8"], "--keep"),
    (
        ["generate", "-m", "{tiny}", "-p", "one two three four five six", "--ctx", "4", "--keep", "-1"],
        "--keep",
    ),
]


@pytest.mark.parametrize("args,message", FILE_CASES, ids=[" ".join(a) for a, _ in FILE_CASES])
def test_bad_files_and_models(args, message, files, tiny_dir):
    before = snapshot(files)
    args = [a.format(**{"in": files, "tiny": tiny_dir}) for a in args]
    code, stderr = invoke(args, files)
    assert_one_line_error(code, stderr, before, message)
    assert not any((files.parent / "cache").glob("*/model.safetensors")), "a broken model was cached"


def test_info_counts_a_huge_model_without_allocating_it(tmp_path):
    """``info`` reads only the config: a vocabulary of 20M (a 328 GB float32 table) is counted on the meta
    device (each parameter was made on the CPU and then moved: "can't allocate memory")."""
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 20000000}')
    r = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "649,705.0 MiB (float32)" in r.stdout


@pytest.mark.parametrize(
    "command,stdin,message",
    [
        ("generate", b"caf\xe9\n", "standard input is not UTF-8"),
        ("chat", b"hello\ncaf\xe9\n", "input line 2: the text holds bytes that are not UTF-8"),
    ],
)
def test_non_utf8_stdin_subprocess(command, stdin, message, tiny_dir, tmp_path):
    before = snapshot(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "selfextend", command, "-m", str(tiny_dir), "-n", "2"],
        input=stdin,
        capture_output=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert_one_line_error(r.returncode, r.stderr.decode(), before, message)


@pytest.mark.parametrize("kind", ["float", "text"])
def test_gguf_metadata_of_the_wrong_type_is_one_line(tmp_path, monkeypatch, kind):
    """``llama.attention.head_count`` stored as 4.0 or "4": huggingface_hub's strict config types raised
    their own exception type, a traceback in info, generate and ppl."""
    import gguf
    from test_models import write_tiny_gguf

    def add_head_count(self, n):
        key = "llama.attention.head_count"
        (self.add_float32(key, float(n)) if kind == "float" else self.add_string(key, str(n)))

    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count", add_head_count)
    path = write_tiny_gguf(tmp_path / "typed.gguf")
    monkeypatch.undo()
    for args in (["info", str(path)], ["generate", "-m", str(path), "-p", "hi", "-n", "2"]):
        r = CliRunner().invoke(main, args)
        lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("compiling the ")]
        assert r.exit_code == 2 and len(lines) == 1 and "num_attention_heads" in lines[0], r.output


def test_gguf_with_blocks_past_its_block_count_is_refused(tmp_path, monkeypatch):
    """A file whose ``block_count`` says 1 of its 2 blocks ran as a 1-layer model (llama.cpp refuses it:
    "wrong number of tensors")."""
    import gguf
    from test_models import write_tiny_gguf

    monkeypatch.setattr(
        gguf.GGUFWriter, "add_block_count", lambda self, n: self.add_uint32("llama.block_count", 1)
    )
    path = write_tiny_gguf(tmp_path / "lies.gguf", layers=2)
    monkeypatch.undo()
    for args in (["info", str(path)], ["generate", "-m", str(path), "-p", "hi", "-n", "2"]):
        r = CliRunner().invoke(main, args)
        lines = [
            x for x in r.stderr.strip().splitlines() if not x.startswith(("compiling the ", "converting "))
        ]
        assert r.exit_code == 2 and len(lines) == 1, r.output
        assert "tensor blk.1.attn_k.weight and 8 more of a block past the 1 its metadata's" in lines[0]


def test_gguf_tensors_the_model_does_not_read_are_named(tmp_path, monkeypatch):
    """Tensors no part of the model reads (a vision tower's, a projector's) were skipped without a word
    (llama.cpp refuses the file), and one named as a query matrix failed the load with a reshape error (the
    Llama processor permuted it): ``info`` and the conversion name them, and the model runs."""
    import gguf
    import numpy as np
    from test_models import write_tiny_gguf

    add = gguf.GGUFWriter.add_name

    def add_name(self, name):
        add(self, name)
        self.add_tensor("v.blk.0.attn_q.weight", np.ones((4, 32), np.float32))
        self.add_tensor("mm.proj.weight", np.ones((4, 32), np.float32))

    monkeypatch.setattr(gguf.GGUFWriter, "add_name", add_name)
    path = write_tiny_gguf(tmp_path / "extra.gguf")
    monkeypatch.undo()
    for args in (["info", str(path)], ["generate", "-m", str(path), "-p", "hi", "-n", "2"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        assert "tensor mm.proj.weight and 1 more of the file has no place in the model: not read" in r.stderr


def test_llama_gguf_with_a_partial_rotation_is_refused(tmp_path, monkeypatch):
    """``rope.dimension_count`` half a Llama's head: transformers took it as the head size and the load
    failed on the query matrix's shape; a Llama does not rotate part of a head (llama.cpp: "invalid
    n_rot"), so the message says that."""
    import gguf
    from test_models import write_tiny_gguf

    rotate = gguf.GGUFWriter.add_rope_dimension_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", lambda self, n: rotate(self, n // 2))
    path = write_tiny_gguf(tmp_path / "half.gguf")
    monkeypatch.undo()
    r = CliRunner().invoke(main, ["info", str(path)])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert "rope.dimension_count 4 rotates part of a head of 8 values" in r.stderr


def test_truncated_gguf_subprocess(real_gguf, tmp_path):
    bad = tmp_path / "half.gguf"
    bad.write_bytes(real_gguf.read_bytes()[: real_gguf.stat().st_size // 2])
    before = snapshot(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), SELFEXTEND_CACHE=str(tmp_path / "cache"))
    r = subprocess.run(
        [sys.executable, "-m", "selfextend", "info", str(bad)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert_one_line_error(r.returncode, r.stderr, before, "truncated")
    assert not (tmp_path / "cache").exists()


# Prompt-cache files: made by a real run on the tiny model, then damaged.


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir))


def _prompt_cache_cases(good: dict) -> dict[str, object]:
    """Each damaged variant of a good payload, by name (the names of PROMPT_CACHE_CASES)."""
    other = torch.float32 if good["keys"][0].dtype == torch.bfloat16 else torch.bfloat16
    return {
        "garbage": b"\x00\x01 not a torch file",
        "other-format": {**good, "format": "selfextend-prompt-cache/1"},
        "no-keys": {k: v for k, v in good.items() if k != "keys"},
        "no-settings": {k: v for k, v in good.items() if k != "settings"},
        "bad-settings": {**good, "settings": "{not json"},
        "float-tokens": {**good, "tokens": good["tokens"].float()},
        "2d-logits": {**good, "logits": good["logits"][None]},
        "layers-missing": {**good, "keys": good["keys"][:1]},
        "bad-shape": {**good, "values": [v[..., :-1] for v in good["values"]]},
        "bad-held": {**good, "held": [[[0, 999]] for _ in good["keys"]]},
        "other-model": {**good, "settings": good["settings"].replace('"model": "', '"model": "x')},
        "not-a-dict": [1, 2, 3],
        "token-past-vocab": {
            **good,
            "tokens": good["tokens"].clone().index_fill_(0, torch.tensor([0]), 10**7),
        },
        "nan-key": {**good, "keys": [k.clone().fill_(float("nan")) for k in good["keys"]]},
        "nan-logits": {**good, "logits": good["logits"].clone().fill_(float("nan"))},
        "other-cells": {  # another --cache-type: was loaded, numbers no run of this one gives
            **good,
            "keys": [k.to(other) for k in good["keys"]],
            "values": [v.to(other) for v in good["values"]],
        },
        "a-chat-session": {**good, "extra": '{"kind": "selfextend-chat/2"}'},  # was loaded, then replaced
    }


@pytest.fixture(scope="module")
def prompt_caches(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("pc")
    good = d / "good.pc"
    r = CliRunner().invoke(
        main, ["generate", "-m", str(tiny_dir), "-p", "hello there", "-n", "2", "--prompt-cache", str(good)]
    )
    assert r.exit_code == 0 and good.is_file(), r.stderr
    payload = torch.load(good, weights_only=True)
    raw = bytearray(good.read_bytes())
    at = raw.find(payload["keys"][0].view(torch.uint8).numpy().tobytes())
    assert at >= 0
    raw[at] ^= 1  # the lowest mantissa bit of the first key: still a number, one no run made
    out = {}
    cut = good.read_bytes()[: good.stat().st_size // 2]  # a write stopped half way: no zip directory
    cases = {**_prompt_cache_cases(payload), "flipped-bit": bytes(raw), "cut-short": cut}
    for name, content in cases.items():
        p = d / f"{name}.pc"
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            torch.save(content, p)
        out[name] = p
    return out


PROMPT_CACHE_CASES = [
    "garbage",
    "other-format",
    "no-keys",
    "no-settings",
    "bad-settings",
    "float-tokens",
    "2d-logits",
    "layers-missing",
    "bad-shape",
    "bad-held",
    "other-model",
    "not-a-dict",
    "token-past-vocab",  # these three were loaded: a NaN key answered with nothing
    "nan-key",
    "nan-logits",
    "other-cells",
    "a-chat-session",
    "flipped-bit",  # loaded without a word: torch.load does not check the zip's CRC-32s
    "cut-short",  # said to be "not a selfextend prompt cache": it is one, cut short
]


@pytest.mark.parametrize("name", PROMPT_CACHE_CASES)
def test_bad_prompt_cache_cli(name, prompt_caches, tiny_dir):
    path = prompt_caches[name]
    before = snapshot(path)
    code, stderr = invoke(
        ["generate", "-m", tiny_dir, "-p", "hello there", "-n", "2", "--prompt-cache", path], path.parent
    )
    assert_one_line_error(code, stderr, before, str(path.name))
    assert name != "cut-short" or "is cut short or damaged" in stderr, stderr


def test_bad_prompt_cache_api(prompt_caches, tiny):
    model, _ = tiny
    for name in ("no-keys", "bad-shape", "bad-held", "garbage", "flipped-bit"):
        cache = ContextShiftCache(model, 64)
        with pytest.raises(PromptCacheError, match=name):
            load_prompt_cache(prompt_caches[name], model, cache, [1, 2, 3])


# Results files: plot over bad records.

RESULTS_CASES = {
    "only-junk": ("not json\n[1, 2]\n", "no records"),
    "unknown-kind": ('{"a": 1}\n{"b": 2}\n', "unknown records"),
    "missing-field": (
        '{"model": "m", "doc": "d", "method": "plain", "length": 2048, "ppl": 3.0}\n',
        "no ppl record",
    ),
    "nan-field": (
        '{"model": "m", "doc": "d", "method": "plain", "length": 2048, "ppl": NaN, "ppl_last": NaN}\n',
        "no ppl record",
    ),
    "empty": ("", "no records"),
}


@pytest.mark.parametrize("name", sorted(RESULTS_CASES))
@pytest.mark.parametrize("command", ["plot", "table"])
def test_unusable_results(name, command, tmp_path):
    content, message = RESULTS_CASES[name]
    path = tmp_path / f"{name}.jsonl"
    path.write_text(content)
    before = snapshot(tmp_path)
    code, stderr = invoke([command, path], tmp_path)
    assert_one_line_error(code, stderr, before, message)
    assert not list(tmp_path.glob("*.png"))


def test_plot_skips_bad_lines_and_other_kinds(tmp_path):
    """Usable records are plotted; the rest is reported (with line numbers) and skipped, never a crash."""
    good = [
        f'{{"model": "m", "doc": "d", "method": "plain", "length": {n}, "ppl": 3.0, "ppl_last": 2.0}}'
        for n in (1024, 2048)
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        "\n".join(
            [
                good[0],
                "[1, 2]",
                '{"method": "plain", "length": 2048, "depth": 0.5, "correct": true}',
                "{cut",
                good[1],
                '{"a": ' * 100_000 + "1" + "}" * 100_000,  # past Python's recursion limit: was the error
            ]
        )
    )
    r = CliRunner().invoke(main, ["plot", str(path), "-o", str(tmp_path / "p.png")])
    assert r.exit_code == 0, r.stderr
    assert (
        "mixed.jsonl: 3 lines are not records, skipped (line 2: JSON but not an object (list); " in r.stderr
    )
    assert "line 4: not JSON (cut off?); line 6: JSON nested too deep)" in r.stderr
    assert "1 record(s) not of kind ppl skipped" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "p.png").stat().st_size > 0


# --------------------------------------------------------------------------------------------------
# API: documented exception types
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    return make_model("llama")


def _llama_with(**overrides) -> torch.nn.Module:
    """The tiny Llama with other sizes."""
    return LlamaForCausalLM(LlamaConfig(**{**COMMON, **overrides})).eval()


def _on_meta() -> torch.nn.Module:
    """The tiny Llama built on the meta device: no weights."""
    with torch.device("meta"):
        return _llama_with()


def _sharing_a_patched_config() -> None:
    """A model built from the config object another model was built from and then Self-Extended (which
    switched the shared config): its forward, which failed with an AttributeError deep inside."""
    config = LlamaConfig(**COMMON)
    apply_self_extend(LlamaForCausalLM(config).eval(), 2, 8)
    LlamaForCausalLM(config).eval()(torch.tensor([[1, 2, 3]]))


API_CASES = {
    "apply None": (lambda m: apply_self_extend(None, 4, 16), ModelError),
    "apply Linear": (lambda m: apply_self_extend(torch.nn.Linear(2, 2), 4, 16), ModelError),
    "remove None": (lambda m: remove_self_extend(None), ModelError),
    "apply bool G": (lambda m: apply_self_extend(m, True, 16), ValidationError),
    "apply float G": (lambda m: apply_self_extend(m, 4.0, 16), ValidationError),
    "apply window = trained": (lambda m: apply_self_extend(m, 4, 64), ValidationError),
    "apply G 0": (lambda m: apply_self_extend(m, 0, 16), ValidationError),
    "apply bad implementation": (lambda m: apply_self_extend(m, 4, 16, "eager"), ValidationError),
    "reach window = trained": (lambda m: max_usable_length(m, 4, 64), ValidationError),
    "reach window > trained": (lambda m: max_usable_length(m.config, 4, 1000), ValidationError),
    "reach None": (lambda m: max_usable_length(None, 4, 16), ModelError),
    "reach nan G": (lambda m: max_usable_length(m, float("nan"), 16), ValidationError),
    "sampling nan temperature": (
        lambda m: SamplingParams(temperature=float("nan")).validate(),
        ValidationError,
    ),
    "sampling nan top-p": (lambda m: SamplingParams(top_p=float("nan")).validate(), ValidationError),
    "sampling bool top-k": (lambda m: SamplingParams(top_k=True).validate(), ValidationError),
    "sampling repeat-last-n -2": (lambda m: SamplingParams(repeat_last_n=-2).validate(), ValidationError),
    "sampling inf penalty": (
        lambda m: SamplingParams(repetition_penalty=float("inf")).validate(),
        ValidationError,
    ),
    "sampling -1 temperature given": (lambda m: SamplingParams(temperature=-1), ValidationError),
    "sampling text temperature given": (lambda m: SamplingParams(temperature="0.5"), ValidationError),
    "sampling top-p 2 given": (lambda m: SamplingParams(top_p=2), ValidationError),
    "generator of a model never loaded": (
        lambda m: Generator(_on_meta(), ContextShiftCache(m, 16)),
        ModelError,
    ),
    "forward of a model whose config another's patch switched": (
        lambda m: _sharing_a_patched_config(),
        ModelError,
    ),
    "generator seed -1": (lambda m: Generator(m, ContextShiftCache(m, 16), seed=-1), ValidationError),
    "generator seed float": (lambda m: Generator(m, ContextShiftCache(m, 16), seed=1.5), ValidationError),
    "generator no cache": (lambda m: Generator(m, None), ValidationError),
    "run -5 tokens": (
        lambda m: next(run(Generator(m, ContextShiftCache(m, 16)), [1, 2], -5)),
        ValidationError,
    ),
    "cache ctx 1": (lambda m: ContextShiftCache(m, 1), ValidationError),
    "cache keep = ctx - 1": (lambda m: ContextShiftCache(m, 10, 9), ValidationError),
    "cache float ctx": (lambda m: ContextShiftCache(m, 10.0), ValidationError),
    "cache of None": (lambda m: ContextShiftCache(None, 16), ModelError),
    "cache of a Linear": (lambda m: ContextShiftCache(torch.nn.Linear(2, 2), 16), ModelError),
    "cache int32 cells": (lambda m: ContextShiftCache(m, 16, dtype=torch.int32), ValidationError),
    "cache dtype name": (lambda m: ContextShiftCache(m, 16, dtype="nope"), ValidationError),
    "cache device name": (lambda m: ContextShiftCache(m, 16, device="nonsense"), ValidationError),
    # 2**54 bytes a tensor, past any address space (overcommitted or not): was torch's allocator's message
    "cache past memory": (lambda m: ContextShiftCache(m, 2**30, batch_size=2**17), ValidationError),
    "cache truncate -5": (lambda m: ContextShiftCache(m, 16).truncate(-5), ValidationError),
    "generator of None": (lambda m: Generator(None, ContextShiftCache(m, 16)), ModelError),
    "generator sampling None": (
        lambda m: Generator(m, ContextShiftCache(m, 16), sampling=None),
        ValidationError,
    ),
    "generator draft text": (lambda m: Generator(m, ContextShiftCache(m, 16), draft="x"), ValidationError),
    "generator lookup and draft": (
        lambda m: Generator(m, ContextShiftCache(m, 16), lookup=4, draft=DraftModel(m)),
        ValidationError,
    ),
    "generator draft of another vocabulary": (
        lambda m: Generator(m, ContextShiftCache(m, 16), draft=DraftModel(_llama_with(vocab_size=300))),
        ValidationError,
    ),
    "generator cache of another model": (
        lambda m: Generator(m, ContextShiftCache(_llama_with(num_key_value_heads=4), 16)),
        ValidationError,
    ),
    "generator bias past the vocabulary": (
        lambda m: Generator(m, ContextShiftCache(m, 16), SamplingParams(logit_bias={97: 1.0})),
        ValidationError,
    ),
    "generator rewind -3": (lambda m: Generator(m, ContextShiftCache(m, 16)).rewind(-3), ValidationError),
    "run text": (lambda m: next(run(Generator(m, ContextShiftCache(m, 16)), "hello", 3)), TokenIdError),
    "run None": (lambda m: next(run(Generator(m, ContextShiftCache(m, 16)), None, 3)), TokenIdError),
    "run floats": (lambda m: next(run(Generator(m, ContextShiftCache(m, 16)), [1.5, 2], 3)), TokenIdError),
    "run bools": (lambda m: next(run(Generator(m, ContextShiftCache(m, 16)), [True], 3)), TokenIdError),
    "run id past the table": (
        lambda m: next(run(Generator(m, ContextShiftCache(m, 16)), [5, 10**6], 3)),
        TokenIdError,
    ),
    "method missing W": (lambda m: Method("selfextend", {"G": 4}), MethodError),
    "method nan factor": (lambda m: Method("ntk", {"factor": float("nan")}), MethodError),
    "method bool G": (lambda m: Method("selfextend", {"G": True, "W": 8}), MethodError),
    "parse None": (lambda m: parse_method(None), MethodError),
    "methods twice": (lambda m: parse_methods(["ntk:factor=2", "ntk:factor=2.0"]), MethodError),
    "plan twice": (
        lambda m: plan("m", {"d": "text"}, [Method("plain"), Method("plain")], [64], "/nonexistent/x.jsonl"),
        MethodError,
    ),
    "lengths bool": (lambda m: check_lengths([True]), ValidationError),
    "lengths string": (lambda m: check_lengths("2k"), ValidationError),
    "passkey nan depth": (
        lambda m: passkey_plan("m", [Method("plain")], [64], [float("nan")], 1, "/nonexistent/x.jsonl"),
        ValidationError,
    ),
    "passkey 0 trials": (
        lambda m: passkey_plan("m", [Method("plain")], [64], [0.5], 0, "/nonexistent/x.jsonl"),
        ValidationError,
    ),
    "bench 0 repeats": (lambda m: BenchConfig([64], [64], repeats=0), ValidationError),
    "bench keep >= ctx": (lambda m: BenchConfig([64], [64], endless_ctx=8, endless_keep=8), ValidationError),
    "read_jsonl directory": (lambda m: read_jsonl(ROOT), ValueError),
}


@pytest.mark.parametrize("name", sorted(API_CASES))
def test_api_refusals(name, tiny_llama):
    call, error = API_CASES[name]
    with pytest.raises(error) as info:
        call(tiny_llama)
    assert isinstance(info.value, ValueError)  # every documented type is a ValueError
    assert "\n" not in str(info.value) and str(info.value)


def test_api_files(files, real_gguf):
    with pytest.raises(ModelError, match="truncated or corrupted"):
        check_gguf(files / "header.gguf")
    with pytest.raises(ModelError, match="truncated"):
        load_model(str(files / "tensor_table.gguf"))
    with pytest.raises(ModelError, match="not valid JSON"):
        load_config(str(files / "badjson"))
    check_gguf(real_gguf)  # the real file passes


def test_numpy_integers_are_integers(tiny_llama):
    assert max_usable_length(tiny_llama, np.int64(4), np.int32(16)) == (64 - 16) * 4 + 16
    apply_self_extend(tiny_llama, np.int64(2), np.int16(8))
    try:
        assert type(tiny_llama.model.layers[0].self_attn.self_extend.group_size) is int
    finally:
        remove_self_extend(tiny_llama)


def test_offline_hub_id_fails_at_once():
    t0 = time.perf_counter()
    with pytest.raises(ModelError, match="cannot load 'selfextend-tests/no-such-model'"):
        load_config("selfextend-tests/no-such-model")
    assert time.perf_counter() - t0 < 15  # no retries (the hub client alone retries for ~30 s)


# --------------------------------------------------------------------------------------------------
# Behaviour that used to be silently wrong
# --------------------------------------------------------------------------------------------------


def test_repeat_last_n_llama_cpp_semantics():
    tokens = list(range(10))
    assert SamplingParams(repeat_last_n=0, repetition_penalty=1.1).recent(tokens) == []
    assert SamplingParams(repeat_last_n=-1, repetition_penalty=1.1).recent(tokens) == tokens
    assert SamplingParams(repeat_last_n=3, frequency_penalty=0.5).recent(tokens) == [7, 8, 9]
    assert SamplingParams(repeat_last_n=3).recent(tokens) == []  # no penalty reads them


def test_resume_keeps_last_record_without_newline_and_sets_bad_lines_aside(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"a": 1}\n[1]\n{"a": 2}\n{"cut": \n{"a": 3}')  # last record lacks its newline
    with pytest.warns(ResultsWarning, match="2 line"):
        repair_tail(p)
    assert p.read_text() == '{"a": 1}\n{"a": 2}\n{"a": 3}\n'
    assert rejected_path(p).read_text() == 'r.jsonl:2: [1]\nr.jsonl:4: {"cut": \n'
    clean = tmp_path / "clean.jsonl"
    clean.write_text('{"a": 1}\n{"a": 2}')
    repair_tail(clean)
    assert clean.read_text() == '{"a": 1}\n{"a": 2}\n' and not rejected_path(clean).exists()


def test_a_sweep_killed_in_its_first_record_resumes(tmp_path):
    """Its file holds one object begun and no newline: it was refused as "not ours" (no record), so the
    same command could not resume. A text of one line, or an object cut before a newline, still is."""
    p = tmp_path / "r.jsonl"
    p.write_text('{"model": "smollm2-135m", "doc": "sherlock-holmes", "meth')
    with pytest.warns(ResultsWarning, match="1 line"):
        repair_tail(p)
    assert p.read_text() == "" and rejected_path(p).read_text().startswith('r.jsonl:1: {"model"')
    for text in ("hello", '{"model": "m", "do\n'):
        other = tmp_path / "other.txt"
        other.write_text(text)
        with pytest.raises(ResultsError, match="holds no results"):
            repair_tail(other)


def test_passkey_resume_keys_include_seed_dtype_and_prompt_form(tmp_path):
    out = tmp_path / "pk.jsonl"
    out.write_text(
        '{"model": "m", "dtype": "float32", "seed": 1, "prompt": 2, "method": "plain", "length": 64, '
        '"depth": 0.5, "trial": 0, "correct": true}\n'
        '{"model": "m", "dtype": "float32", "seed": 0, "prompt": 2, "method": "plain", "length": 64, '
        '"depth": 0.5, "trial": 1, "correct": true}\n'
        '{"model": "m", "method": "plain", "length": 64, "depth": 0.5, "trial": 0, "correct": true}\n'
    )
    args = ("m", [Method("plain")], [64], [0.5], 2, out)
    assert [p.trial for p in passkey_plan(*args, "float32", 1)] == [1]
    # the old record (seed 0, float32, the first prompt form) is asked again in the current form
    assert [p.trial for p in passkey_plan(*args, "float32", 0)] == [0]
    assert [p.trial for p in passkey_plan(*args, "float32", 2)] == [0, 1]
    assert [p.trial for p in passkey_plan(*args, "bfloat16", 1)] == [0, 1]


def test_method_spelling_is_canonical():
    assert parse_method("selfextend:W=1024,G=4").name == "selfextend:G=4,W=1024"
    assert parse_method("shift:keep=0,ctx=64").name == "shift:ctx=64"


def test_sigterm_stops_generate_like_ctrl_c(tiny_dir, tmp_path):
    out = tmp_path / "gen.txt"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "selfextend",
            "generate",
            "-m",
            str(tiny_dir),
            "-p",
            "hello",
            "-n",
            "-1",
            "--ignore-eos",
            "--ctx",
            "32",
            "-o",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    deadline = time.time() + 240
    while time.time() < deadline and (not out.exists() or out.stat().st_size < 50):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr  # 128 + SIGTERM, as a sweep's
    assert "Traceback" not in stderr.decode()
    summary = stderr.decode().strip().splitlines()[-1]
    assert "stopped: terminated (SIGTERM)" in summary and "context shift" in summary
    # Everything streamed was flushed. Bytes, not text: a random token may hold "\r", which
    # read_text's universal newlines would turn into "\n".
    assert out.read_bytes() and out.read_bytes() in stdout


# --------------------------------------------------------------------------------------------------
# The server under faults: one request's failure ends that request only, a failed step leaves its slot
# consistent, abandoned and oversized requests free the engine at once (real loopback, real `openai`)
# --------------------------------------------------------------------------------------------------


class PoisonRows:
    """A test hook in place of an engine's batched step: the logits of slot ``slot``'s sequence turn NaN
    from its ``after``-th step on (a float16 model overflowing, say); every other row is left alone."""

    def __init__(self, engine: Engine, slot: int, after: int) -> None:
        self.engine, self.inner, self.slot, self.after, self.steps = engine, engine.batched, slot, after, 0

    def __call__(self, pairs):
        out = self.inner(pairs)
        target = self.engine.slots[self.slot].gen
        for i, (gen, _) in enumerate(pairs):
            if gen is target:
                self.steps += 1
                if self.steps >= self.after:
                    out[i] = torch.full_like(out[i], float("nan"))
        return out


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)


def test_nan_logits_end_one_stream_while_another_finishes(tiny):
    model, tok = tiny
    with serving(model, tok, n_ctx=128, parallel=2, max_tokens=64) as (base, engine):
        engine.batched = PoisonRows(engine, slot=0, after=3)
        client, out = _client(base), {}
        common = dict(model="t", max_tokens=40, stream=True)

        def victim() -> None:  # sampled with top_k 0: NaN logits make torch.multinomial raise
            extra = {"id_slot": 0, "top_k": 0, "ignore_eos": True}
            stream = client.completions.create(
                **common, prompt="Once upon a time", temperature=1.0, extra_body=extra
            )
            out["victim_text"] = []
            try:
                for chunk in stream:
                    out["victim_text"].append(chunk.choices[0].text)
            except openai.APIError as e:
                out["victim"] = e

        def other() -> None:
            extra = {"id_slot": 1, "ignore_eos": True}
            chunks = list(
                client.completions.create(**common, prompt="The sea is", temperature=0, extra_body=extra)
            )
            out["other"] = chunks[-1].choices[0].finish_reason

        side_by_side(engine, [victim, other])  # both queued before the engine takes either
        assert "generation failed" in str(out["victim"]) and out["victim_text"]  # it failed mid-stream
        assert out["other"] == "length"  # the other stream ran to its end
        assert (engine.metrics.failed, engine.metrics.requests) == (1, 1)  # /metrics counts the failure
        # top_k > 0: no finite logit to choose among; a plain request gets an OpenAI error body
        with pytest.raises(openai.InternalServerError, match="generation failed"):
            client.completions.create(
                model="t",
                prompt="Again",
                max_tokens=8,
                temperature=1.0,
                extra_body={"id_slot": 0, "top_k": 5},
            )
        status, health = request(base, "GET", "/health")
        assert status == 200 and health["slots_idle"] == 2 and engine.thread.is_alive()
        engine.batched = engine.batched.inner
        reply = client.completions.create(model="t", prompt="Still here?", max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop")


def _ask(engine: Engine, prompt: list[int], max_tokens: int = 8) -> tuple[str, dict]:
    """(text, last event) of one greedy job on ``engine``."""
    reply = Reply()
    assert engine.submit(
        Job(list(prompt), 0, SamplingParams(temperature=0), max_tokens, reply.emit, ignore_eos=True)
    )
    return reply.wait(120)


@contextlib.contextmanager
def _engine(model, tok, n_ctx: int = 128) -> Iterator[Engine]:
    engine = Engine(model, tok, n_ctx, 1, 0)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def _fresh(model, tok, prompt: list[int]) -> tuple[str, list[int], torch.Tensor]:
    """(text, cached tokens, last logits) of ``prompt`` on a fresh engine."""
    with _engine(model, tok) as engine:
        text, end = _ask(engine, prompt)
        gen = engine.slots[0].gen
        assert end["type"] == "done"
        return text, list(gen.tokens), gen.last_logits.clone()


def _fills(engine: Engine) -> tuple[set[int], int]:
    """(where each layer of the slot's cache ends, how many tokens it records)."""
    gen = engine.slots[0].gen
    return {layer.next_pos for layer in gen.cache.layers}, len(gen.tokens)


def _fails_once(call, at: int, error: Exception):
    """``call`` that raises ``error`` on its ``at``-th call (counting from 1)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise error
        return call(*args, **kwargs)

    return wrapped


def test_failed_prefill_leaves_the_slot_as_a_fresh_one(tiny):
    """A RuntimeError in layer 1 while the second piece of a prompt is read (layer 0 has taken its cells):
    the retry of the same prompt answers as a fresh slot does, to the logits."""
    model, tok = tiny
    prompt = list(range(1000, 1100))  # 100 tokens in 128 cells: pieces of 64 and 36, no shift
    want = _fresh(model, tok, prompt)
    layer = model.model.layers[1]
    with _engine(model, tok) as engine:
        layer.forward = _fails_once(layer.forward, 2, RuntimeError("injected failure"))
        try:
            _, end = _ask(engine, prompt)
        finally:
            del layer.forward
        assert end["type"] == "error" and "injected failure" in end["message"]
        fills, n = _fills(engine)
        text, _ = _ask(engine, prompt)
        gen = engine.slots[0].gen
        assert (text, gen.tokens) == want[:2]
        torch.testing.assert_close(gen.last_logits, want[2], atol=1e-5, rtol=1e-5)
        assert fills == {n}  # every layer at one fill, the one the tokens say


def test_failed_decode_step_leaves_the_slot_consistent(tiny):
    """A MemoryError midway through a decode step (layers 0 and 1 have taken the token's cell, as the
    kernels' scratch allocation failing would leave them): a next prompt that goes on from what the slot
    holds answers as a fresh slot does."""
    model, tok = tiny
    with _engine(model, tok) as engine:
        step = engine.slots[0].backends.rows
        assert step is not None and step.supported()
        plan = step.plan[1]
        step.plan[1] = plan._replace(o_proj=_fails_once(plan.o_proj, 3, MemoryError("no scratch space")))
        try:
            _, end = _ask(engine, list(range(500, 540)))
        finally:
            step.plan[1] = plan
        assert end["type"] == "error" and "no scratch space" in end["message"]
        fills, n = _fills(engine)
        held = list(engine.slots[0].gen.tokens)
        assert len(held) > 40  # the failed step came after some tokens of the reply
        text, _ = _ask(engine, [*held, 7, 8, 9])
        gen = engine.slots[0].gen
        want = _fresh(model, tok, [*held, 7, 8, 9])
        assert (text, gen.tokens) == want[:2]
        torch.testing.assert_close(gen.last_logits, want[2], atol=1e-4, rtol=1e-4)
        assert fills == {n}  # every layer at one fill, the one the tokens say


@pytest.mark.parametrize("bad", [10**9, -1, 1.5])
def test_slot_file_whose_history_is_not_token_ids_is_refused(tiny, tmp_path, bad):
    """A slot file whose history holds what is not one of the model's ids (a file edited or of another
    model) is refused with a 400, and the slot keeps what it held (it was emptied)."""
    from selfextend.server.guard import APIError

    model, tok = tiny
    slot = Slot(0, model, 64, decode_backends(model))
    slot.generator(0).feed(list(range(200, 230)))
    slot.finish(list(range(200, 230)), [], True)
    slot.history[3] = bad
    slotfiles.save(slot, tmp_path / "s.slot", "tiny")
    other = Slot(1, model, 64, slot.backends)
    logits = other.generator(0).feed(list(range(300, 310)))
    other.finish(list(range(300, 310)), [], True)
    with pytest.raises(APIError, match="damaged slot state") as e:
        slotfiles.restore(other, tmp_path / "s.slot", "tiny")
    assert e.value.status == 400 and other.gen.tokens == list(range(300, 310))
    torch.testing.assert_close(
        other.gen.write([5]), Slot(2, model, 64, slot.backends).generator(0).feed([*range(300, 310), 5])
    )
    assert torch.isfinite(logits).all()


def test_slot_files_that_are_no_slot_files_are_refused_by_name(tiny, tmp_path):
    """Saving over a folder or a file that is no saved cache: a 400, nothing replaced (a folder was a 500
    with a traceback). Restoring junk: a 400 naming the file, not the server's folder; the slot kept."""
    from selfextend.server.guard import APIError

    model, tok = tiny
    slot = Slot(0, model, 64, decode_backends(model))
    slot.generator(0).feed(list(range(200, 230)))
    slot.finish(list(range(200, 230)), [], True)
    (tmp_path / "dir.bin").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    for name in ("dir.bin", "notes.txt"):
        with pytest.raises(APIError, match=f"{name} is there and is not a saved cache") as e:
            slotfiles.save(slot, tmp_path / name, "tiny")
        assert e.value.status == 400
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(APIError, match="notes.txt") as e:
        slotfiles.restore(slot, tmp_path / "notes.txt", "tiny")
    assert e.value.status == 400 and str(tmp_path) not in str(e.value) and len(slot.gen.tokens) == 30


def test_slot_restore_failing_unexpectedly_leaves_the_slot_empty(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    slot = Slot(0, model, 64, decode_backends(model))
    gen = slot.generator(0)
    gen.feed(list(range(200, 230)))
    slot.finish(list(range(200, 230)), [], True)
    slotfiles.save(slot, tmp_path / "s.slot", "tiny")
    other = Slot(1, model, 64, slot.backends)
    other.generator(0).feed(list(range(300, 310)))
    real = ContextShiftCache.load_prefix

    def half(self, keys, values, n_past, positions=None):
        self.layers[0].fill(
            keys[0][..., :n_past, :], values[0][..., :n_past, :], torch.arange(n_past), n_past
        )
        raise RuntimeError("injected failure")

    monkeypatch.setattr(ContextShiftCache, "load_prefix", half)
    with pytest.raises(RuntimeError, match="injected"):
        slotfiles.restore(other, tmp_path / "s.slot", "tiny")
    monkeypatch.setattr(ContextShiftCache, "load_prefix", real)
    assert other.gen.tokens == [] and other.history == []
    assert all(layer.n_used == 0 and layer.next_pos == 0 for layer in other.gen.cache.layers)
    fresh = Slot(2, model, 64, slot.backends).generator(0)
    torch.testing.assert_close(other.gen.feed([5, 6, 7]), fresh.feed([5, 6, 7]))


def test_slot_actions_are_answered_when_the_loop_ends(tiny, monkeypatch):
    """A slot action waiting as the loop stops is run; one handed in later, or waiting when the loop dies of
    an error, gets an answer too (never a wait for good), and so does a queued request."""
    model, tok = tiny
    engine = Engine(model, tok, 32)
    answers: list = []
    waiting = threading.Thread(target=lambda: answers.append(engine.with_slot(0, lambda s: s.id + 40)))
    waiting.start()
    deadline = time.monotonic() + 10
    while not engine.tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.stop()  # the loop has not run yet: it starts with a stop pending and a task queued
    engine.run_loop()
    waiting.join(10)
    assert answers == [40]
    with pytest.raises(Stopped):
        engine.with_slot(0, lambda s: s.id)

    broken = Engine(model, tok, 32)
    monkeypatch.setattr(broken, "_assign", lambda: 1 / 0)
    events: list[dict] = []
    broken.submit(Job([1, 2, 3], 0, SamplingParams(), 4, events.append))
    errors: list[Exception] = []

    def act() -> None:
        try:
            broken.with_slot(0, lambda s: s.id)
        except Exception as e:
            errors.append(e)

    waiting = threading.Thread(target=act)
    waiting.start()
    while not broken.tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ZeroDivisionError):
        broken.run_loop()
    waiting.join(10)
    assert [type(e) for e in errors] == [Stopped] and events[-1]["type"] == "error"
    idle = Engine(model, tok, 32)  # no loop at all: the wait is bounded and withdraws the action
    with pytest.raises(TimeoutError):
        idle.with_slot(0, lambda s: s.id, wait=0.2)
    assert not idle.tasks


def test_plain_request_whose_client_left_is_cancelled(tiny):
    model, tok = tiny
    with serving(model, tok, n_ctx=64, parallel=1, max_tokens=100_000) as (base, engine):
        inner, after_cancel = engine.batched, []

        def counted(pairs):
            if engine.running and engine.running[0].job.cancelled.is_set():
                after_cancel.append(len(pairs))
            return inner(pairs)

        engine.batched = counted
        conn = connect(base)
        body = {"prompt": "Go on forever", "max_tokens": 100_000, "ignore_eos": True, "temperature": 0}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        slot = engine.slots[0]
        deadline = time.monotonic() + 30
        while not (slot.gen and slot.gen.cache.shifts >= 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slot.busy and slot.gen.cache.shifts >= 1  # well under way (64 cells: it has shifted)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.monotonic() + 15
        while slot.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not slot.busy and len(after_cancel) <= 1  # freed within a step of the cancellation
        shifts = slot.gen.cache.shifts
        time.sleep(0.3)
        assert slot.gen.cache.shifts == shifts and request(base, "GET", "/health")[0] == 200
        status, text = request(base, "GET", "/metrics")  # a cancelled request was counted nowhere
        assert status == 200 and "llamacpp:requests_cancelled_total 1\n" in text, text
        assert "llamacpp:requests_total 0\n" in text and "llamacpp:requests_failed_total 0\n" in text


def _timed_health(base: str, stop: threading.Event, waits: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        status, _ = request(base, "GET", "/health", timeout=30)
        assert status == 200
        waits.append(time.perf_counter() - t0)
        time.sleep(0.02)


def test_four_million_token_body_is_refused_at_once(tiny):
    """An 8 MB body of token ids (4,000,000 of them, under the 8 MiB body limit) is a 400 naming the prompt
    limit, answered in seconds (not prefilled through shifts); /health answers all the while."""
    model, tok = tiny
    with serving(model, tok, n_ctx=128, parallel=1) as (base, engine):
        body = b'{"max_tokens": 1, "prompt": [' + b",".join([b"1"] * 4_000_000) + b"]}"
        assert len(body) < 8 * 2**20
        stop, waits = threading.Event(), []
        health = threading.Thread(target=_timed_health, args=(base, stop, waits))
        health.start()
        t0 = time.perf_counter()
        try:
            status, out = request(base, "POST", "/v1/completions", body, timeout=60)
        finally:
            stop.set()
            health.join(30)
        took = time.perf_counter() - t0
        assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
        assert "at most 512" in out["error"]["message"] and out["error"]["param"] == "prompt"
        assert took < 30 and waits and max(waits) < 5.0, (took, max(waits, default=None))  # 0.8 s, 0.7 s here
        assert not engine.queue and not any(s.busy for s in engine.slots)
        at_limit = [1] * 512
        reply = _client(base).completions.create(model="t", prompt=at_limit, max_tokens=1)
        assert reply.usage.prompt_tokens == 512
        with pytest.raises(openai.BadRequestError, match="513 tokens; this server takes at most 512"):
            _client(base).completions.create(model="t", prompt=[*at_limit, 1], max_tokens=1)


def test_serve_help_documents_the_prompt_limit():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "selfextend", "serve", "--help"], capture_output=True, text=True, env=env
    )
    text = " ".join(out.stdout.split())
    assert "--max-prompt-tokens" in text and "in tokens (default: 4 x --ctx)" in text and "400" in text


ENCODING_CASES = [
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": ["caf\udce9"]}, "prompt"),
    ({"prompt": "a\x00b"}, "prompt"),
    ({"prompt": "ab", "stop": ["\ud800"]}, "stop.0"),
    ({"prompt": "ab", "stop": "\x00"}, "stop"),
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    (
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "\x00"}]},
        "messages.1.content",
    ),
]


@pytest.fixture(scope="module")
def small_server(tiny):
    model, tok = tiny
    with serving(model, tok, n_ctx=64) as (base, _):
        yield base


@pytest.mark.parametrize(
    "body,param", ENCODING_CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(ENCODING_CASES)]
)
def test_text_that_cannot_be_encoded_is_a_400(small_server, body, param):
    """A lone surrogate (JSON spells one as ``"\\ud800"``; the ``openai`` client cannot send it, so the
    body goes as JSON with ASCII escapes) or a NUL (through the real client): a 400 naming the field, never
    a 500."""
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    status, out = request(small_server, "POST", path, json.dumps({**body, "max_tokens": 2}).encode())
    error = out["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", out
    assert set(error) == {"message", "type", "param", "code"}
    assert request(small_server, "GET", "/health")[0] == 200
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate: the openai client cannot send it
        return
    client = _client(small_server)
    create = client.completions.create if "prompt" in body else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        create(model="t", max_tokens=2, **body)
    assert e.value.body["param"] == param


def test_a_cache_root_that_is_a_file_is_said_once(tmp_path):
    """$SELFEXTEND_CACHE naming a file: `cache list` said "(empty)", `generate` fell back to the reference
    products with a cryptic warning and failed later on the tokenizer's folder. One line, exit 2, first."""
    root = tmp_path / "cache"
    root.write_text("not a folder")
    for args in (["cache", "list"], ["generate", "-p", "hi", "-n", "1"]):
        r = CliRunner().invoke(main, args, env={"SELFEXTEND_CACHE": str(root)})
        assert r.exit_code == 2 and r.stderr.strip() == (
            f"error: the cache root {root} is not a folder: set SELFEXTEND_CACHE to a folder"
        ), r.stderr
    assert root.read_text() == "not a folder"
