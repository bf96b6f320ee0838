"""``selfextend bench --cases server``: finding llama-server (one-line errors), the command lines both servers
get (ours parsed by ``serve``'s own options), the streaming load clients and the trimmed chat against a real
server on a loopback socket (a tiny model in this process), and, where a llama-server binary is found
(``$LLAMA_SERVER`` or ``$PATH``; CI has none), one short real run of the case. No timing is asserted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from server_util import serving
from transformers import AutoTokenizer, LlamaForCausalLM

from selfextend.bench.clients import SAME_REPLY, run_phase
from selfextend.bench.servers import (
    ServerSetup,
    YardstickError,
    command,
    find_llama_server,
    ratios,
)
from selfextend.bench.trimmed_chat import SYSTEM, conversation, rendered_tokens, trimmed_median
from selfextend.cli.main import main
from selfextend.cli.serve import serve


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_llama_server_found_on_path_or_refused_in_one_line(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(YardstickError, match=r"no llama-server on \$PATH"):
        find_llama_server()
    on_path = tmp_path / "bin"
    on_path.mkdir()
    binary = _executable(on_path / "llama-server")
    monkeypatch.setenv("PATH", str(on_path))
    assert find_llama_server() == binary
    assert find_llama_server(str(binary)) == binary
    plain = tmp_path / "plain"
    plain.write_text("not a program")
    with pytest.raises(YardstickError, match="not executable"):
        find_llama_server(plain)
    with pytest.raises(YardstickError, match="no such file"):
        find_llama_server(tmp_path / "missing")


@pytest.mark.parametrize(
    "args, said",
    [
        ([], "no llama-server on $PATH"),
        (["--llama-server", "{missing}"], "no such file"),
        (["--llama-server", "{plain}"], "not executable"),
        (["--turns", "31"], "--turns"),
        (["--clients", "0"], "--clients"),
        (["--parallel", "0"], "--parallel"),
    ],
)
def test_server_case_refusals_are_one_line(tmp_path, monkeypatch, args, said):
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "plain").write_text("x")
    args = [a.format(missing=tmp_path / "missing", plain=tmp_path / "plain") for a in args]
    r = CliRunner().invoke(main, ["bench", "--cases", "server", *args])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and said in lines[0], r.stderr


def test_server_case_needs_a_gguf(tmp_path, tiny_dir):
    binary = _executable(tmp_path / "llama-server")
    r = CliRunner().invoke(
        main, ["bench", "--cases", "server", "--llama-server", str(binary), "-m", str(tiny_dir)]
    )
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1
    assert lines[0].startswith("error: Invalid value for --model: the server case needs a GGUF model")


def test_both_servers_get_the_same_settings(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")  # serve's parser checks that a named .gguf is there
    setup = ServerSetup(gguf, Path("/opt/llama-server"), parallel=3, ctx=512, threads=2, cache_type="bf16")
    theirs = command("llama-server", setup, 8123)
    flags = {
        a: b if not b.startswith("-") else True
        for a, b in zip(theirs[1:], [*theirs[2:], "-"], strict=True)
        if a[0] == "-"
    }
    assert flags["--no-kv-unified"] is True  # -c is the pool of all slots, split evenly
    assert theirs[0] == "/opt/llama-server" and flags["-m"] == str(gguf) and flags["--port"] == "8123"
    assert (flags["-np"], flags["-c"], flags["-t"], flags["-ctk"]) == ("3", str(3 * 512), "2", "bf16")
    ours = command("selfextend", setup, 8123)
    assert ours[:4] == [sys.executable, "-m", "selfextend", "serve"]
    params = serve.make_context("serve", ours[4:]).params  # serve's own parser takes the line
    assert (params["model"], params["port"], params["parallel"], params["ctx"]) == (str(gguf), 8123, 3, 512)
    assert (params["cache_reuse"], params["cache_type"], params["weights"]) == (256, "bf16", "auto")


def test_ratios_are_ours_over_theirs_per_field_both_have():
    records = [
        {"server": "selfextend", "phase": "load", "aggregate_tokens_per_second": 30.0, "ttft_p50_s": 0.5},
        {"server": "llama-server", "phase": "load", "aggregate_tokens_per_second": 20.0, "ttft_p50_s": 2.0},
        {"server": "selfextend", "phase": "trimmed_chat", "ttft_median_s": 1.0},
    ]
    assert ratios(records) == {"aggregate_tokens_per_second": 1.5, "ttft_p50_s": 0.25}


@pytest.fixture(scope="module")
def tiny_server(tiny_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_dir).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    with serving(model, tok, n_ctx=512, parallel=2, cache_reuse=4) as (base, _):
        yield base, tok


def test_load_phase_streams_full_replies_on_the_same_prompts(tiny_server):
    base, tok = tiny_server
    clients, count, tokens = 2, 3, 5
    out = run_phase(base, clients, count, max_tokens=tokens, full=True, same_history=True)
    assert (out["requests"], out["ok"], out["4xx"], out["5xx"]) == (6, 6, 0, 0)
    assert out["completion_tokens"] == clients * count * tokens  # ignore_eos: every reply runs to the end
    assert out["ttft_p50_s"] is not None and out["ttft_p95_s"] >= out["ttft_p50_s"]
    expected = 0  # the prompts a client sends, rendered here: its last 7 messages, replies fixed
    for i in range(clients):
        history = [{"role": "system", "content": f"You are assistant number {i}. Be brief."}]
        for q in range(count):
            history.append({"role": "user", "content": f"Question {q}: name something blue, number {q}."})
            expected += rendered_tokens(tok, history[-7:])
            history.append({"role": "assistant", "content": SAME_REPLY})
    assert out["prompt_tokens"] == expected
    assert 0 < out["cached_prompt_tokens"] < expected  # later turns reuse their conversation's prefix


def test_trimmed_chat_trims_and_reuses(tiny_server):
    base, tok = tiny_server
    rows = conversation(base, tok, True, turns=6, reply=SAME_REPLY, budget=200)
    assert [r["turn"] for r in rows] == list(range(1, 7))
    first = next(r["turn"] for r in rows if r["dropped_exchanges"])
    assert 1 < first <= 6 and trimmed_median(rows)[0] == first
    for r in rows:
        assert r["computed_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
        assert r["reply_tokens"] >= 1 and r["ttft_s"] > 0
    # after the first turn, the kept exchanges are found in the cache (the trimmed turns: moved by K-shift)
    assert all(r["cached_tokens"] > 0 for r in rows[1:])
    assert any((r["moved_tokens"] or 0) > 0 for r in rows if r["dropped_exchanges"])
    assert rendered_tokens(tok, [{"role": "system", "content": SYSTEM}]) < rows[0]["prompt_tokens"]


def _llama_server() -> str | None:
    return os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")


@pytest.mark.real
@pytest.mark.skipif(
    _llama_server() is None, reason="no llama-server binary ($LLAMA_SERVER or on $PATH; CI has no llama.cpp)"
)
def test_server_case_against_llama_server(tmp_path):
    out = tmp_path / "server.jsonl"
    args = ["--llama-server", _llama_server(), "--repeats", "1", "--parallel", "1", "--ctx", "512"]
    args += ["--clients", "1", "--requests", "2", "--reply-tokens", "4", "--turns", "2", "-t", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "selfextend", "bench", "--cases", "server", *args, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    loads = {r["server"]: r for r in records if r.get("phase") == "load"}
    assert set(loads) == {"selfextend", "llama-server"}
    for r in loads.values():
        assert (r["ok"], r["5xx"], r["completion_tokens"]) == (2, 0, 8)
    assert loads["selfextend"]["prompt_tokens"] == loads["llama-server"]["prompt_tokens"]
    chats = [r for r in records if r.get("phase") == "trimmed_chat"]
    assert len(chats) == 2 and all(len(c["ttft_s"]) == 2 for c in chats)
    summary = records[-1]
    assert summary["summary"] and set(summary["median_ratios"]) >= {"aggregate_tokens_per_second"}
    assert "ours/theirs" in done.stdout


def test_setup_refuses_counts_the_cli_refuses(tmp_path):
    from selfextend.core.validate import ValidationError

    with pytest.raises(ValidationError, match="parallel"):
        ServerSetup(tmp_path / "m.gguf", Path("llama-server"), parallel=0)
    with pytest.raises(ValidationError, match="turns"):
        ServerSetup(tmp_path / "m.gguf", Path("llama-server"), turns=31)
