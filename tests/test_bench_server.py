"""``selfextend bench --cases server``: finding llama-server (one-line errors), the command lines both servers
get (ours parsed by ``serve``'s own options), the streaming load clients and the trimmed chat against a real
server on a loopback socket (a tiny model in this process), the whole case against llama-server's own
answers recorded from the real binary and replayed (and against the binary itself where one is found:
``$LLAMA_SERVER`` or ``$PATH``; CI has none), each run's own log folder, a port lost before its bind, and
llama-server's environment without our OpenMP waits. No timing is asserted."""

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

from selfextend.bench import servers
from selfextend.bench.clients import SAME_REPLY, get, run_phase
from selfextend.bench.servers import (
    ServerSetup,
    YardstickError,
    command,
    find_llama_server,
    ratios,
    start_on_a_free_port,
    stop,
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
    setup = ServerSetup(
        gguf, Path("/opt/llama-server"), parallel=3, ctx=512, threads=2, cache_type="bf16", logs=tmp_path
    )
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


DATA = Path(__file__).parent / "data" / "llama_server"
# the bench's server case as experiments/tools/record_llama_server.py recorded llama-server's answers to it
CASE = ["--repeats", "1", "--parallel", "1", "--ctx", "512", "--clients", "1", "--requests", "2"]
CASE += ["--reply-tokens", "4", "--turns", "2", "-t", "1"]


def _server_case(binary: str | Path, gguf: Path, out: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``selfextend bench --cases server`` of :data:`CASE` on ``gguf`` against ``binary``, in an environment
    without OpenMP variables (as a user's): the run and its records."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["TMPDIR"] = str(out.parent)  # the run's log folder beside its records
    cmd = [sys.executable, "-m", "selfextend", "bench", "--cases", "server", "-m", str(gguf)]
    cmd += ["--llama-server", str(binary), *CASE, "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, [json.loads(line) for line in out.read_text().splitlines()]


def _check_case(done: subprocess.CompletedProcess, records: list[dict]) -> None:
    loads = {r["server"]: r for r in records if r.get("phase") == "load"}
    assert set(loads) == {"selfextend", "llama-server"}
    for r in loads.values():
        assert (r["ok"], r["5xx"], r["completion_tokens"]) == (2, 0, 8)
    assert loads["selfextend"]["prompt_tokens"] == loads["llama-server"]["prompt_tokens"] > 0
    chats = [r for r in records if r.get("phase") == "trimmed_chat"]
    assert len(chats) == 2 and all(len(c["ttft_s"]) == 2 for c in chats)
    summary = records[-1]
    assert summary["summary"] and set(summary["median_ratios"]) >= {"aggregate_tokens_per_second"}
    assert "ours/theirs" in done.stdout
    assert "GOMP_SPINCOUNT=10000 for ours, llama-server's default for it" in done.stdout


def test_server_case_against_llama_server(tmp_path):
    """The whole case (both servers started, the load phase, the trimmed chat, the records, the ratios and
    the table) against llama-server's own answers, recorded from the real binary built from the
    llama-cpp-python 0.3.36 sdist and replayed (tests/llama_server_replay.py: it computes nothing, and
    refuses a command line or OpenMP variables other than those llama-server was recorded with). Made by
    ``.venv/bin/python experiments/tools/record_llama_server.py /path/to/llama.cpp /path/to/llama-server``;
    a change to what the case sends llama-server (its flags, the requests) needs a new recording. Both
    servers count the same prompt tokens: llama.cpp's tokenizer and template against ours, on one file."""
    replay = Path(__file__).parent / "llama_server_replay.py"
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {replay} {DATA / "replay.json"} "$@"\n')
    binary.chmod(0o755)
    _check_case(*_server_case(binary, DATA / "tiny-chat.gguf", tmp_path / "server.jsonl"))


@pytest.mark.real
@pytest.mark.skipif(
    _llama_server() is None, reason="no llama-server binary ($LLAMA_SERVER or on $PATH; CI has no llama.cpp)"
)
def test_server_case_against_a_real_llama_server(tmp_path):
    """The same case against the binary itself, where there is one."""
    _check_case(*_server_case(_llama_server(), DATA / "tiny-chat.gguf", tmp_path / "server.jsonl"))


def test_each_run_logs_into_a_folder_of_its_own(tmp_path):
    """Concurrent runs never write over each other's server logs (they shared /tmp's fixed names)."""
    a, b = (ServerSetup(tmp_path / "m.gguf", Path("llama-server")) for _ in range(2))
    try:
        assert a.logs != b.logs and a.logs.is_dir() and b.logs.is_dir()
    finally:
        for folder in (a.logs, b.logs):
            shutil.rmtree(folder, ignore_errors=True)


def test_a_port_taken_before_the_bind_is_tried_again(tmp_path):
    """A server that exits saying it could not bind (its port taken between the pick and the bind) is
    started again on another port; any other early exit is reported at once."""
    marker = tmp_path / "tried"
    fake = tmp_path / "llama-server"
    fake.write_text(
        f"""#!{sys.executable}
import http.server, pathlib, sys
marker = pathlib.Path({str(marker)!r})
if sys.argv[-1] == "fail":
    sys.exit("some other error")
if not marker.exists():
    marker.write_text("x")
    sys.exit("couldn't bind HTTP server socket, hostname: 127.0.0.1")
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
    )
    fake.chmod(0o755)
    setup = ServerSetup(tmp_path / "m.gguf", fake, logs=tmp_path)
    proc, base = start_on_a_free_port("llama-server", setup, tmp_path / "log")
    try:
        assert marker.exists() and get(base, "/health") == 200
    finally:
        stop(proc)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(servers, "command", lambda name, s, port: [str(fake), "--port", str(port), "fail"])
        with pytest.raises(RuntimeError, match="some other error"):
            start_on_a_free_port("llama-server", setup, tmp_path / "log")


def test_llama_server_waits_as_built(monkeypatch):
    """llama-server's environment lacks the OpenMP variable our CLI set for itself; a user's stays."""
    from selfextend.cli import options

    monkeypatch.setattr(options, "QUIETED", ["GOMP_SPINCOUNT"])
    environ = {"GOMP_SPINCOUNT": "10000", "PATH": "/bin", "OMP_WAIT_POLICY": "passive"}
    assert options.without_our_waits(environ) == {"PATH": "/bin", "OMP_WAIT_POLICY": "passive"}
    monkeypatch.setattr(options, "QUIETED", [])
    assert options.without_our_waits(environ) == environ


def test_setup_refuses_counts_the_cli_refuses(tmp_path):
    from selfextend.core.validate import ValidationError

    with pytest.raises(ValidationError, match="parallel"):
        ServerSetup(tmp_path / "m.gguf", Path("llama-server"), parallel=0)
    with pytest.raises(ValidationError, match="turns"):
        ServerSetup(tmp_path / "m.gguf", Path("llama-server"), turns=31)
