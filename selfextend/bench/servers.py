"""``selfextend serve`` against llama.cpp's own ``llama-server`` on the same GGUF, one at a time on
loopback: the same slots, cells per slot, cell type, threads and cache-reuse chunk; the same load and the
same trimmed chat, rounds interleaved (ours, theirs; theirs, ours; ...), ours over theirs per round.

Each server is started as a subprocess (``python -m selfextend serve``; the ``llama-server`` binary), gets
one warm-up request, the load phase (:func:`~selfextend.bench.clients.run_phase`, every reply running to
``max_tokens`` and entering its conversation as one fixed text, so both do the same work on the same
prompts) and, with ``turns``, the trimmed chat (:mod:`~selfextend.bench.trimmed_chat`), and is stopped.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from selfextend.bench.clients import SAME_REPLY, get, run_phase
from selfextend.bench.trimmed_chat import TOPICS, conversation, trimmed_median
from selfextend.core.validate import check_int

SERVERS = ("selfextend", "llama-server")


class YardstickError(ValueError):
    """A yardstick that cannot run as asked (no llama-server binary); the message is one line."""


def find_llama_server(path: str | os.PathLike[str] | None = None) -> Path:
    """The ``llama-server`` binary: ``path`` if given, else the one on ``$PATH``. Raises
    :class:`YardstickError` when there is none, or ``path`` is not an executable file."""
    if path is None:
        found = shutil.which("llama-server")
        if found is None:
            raise YardstickError(
                "no llama-server on $PATH: build llama.cpp (its llama-server target) and name the binary "
                "with --llama-server PATH"
            )
        return Path(found)
    binary = Path(path).expanduser()
    if not binary.is_file():
        raise YardstickError(f"no such file: {binary}")
    if not os.access(binary, os.X_OK):
        raise YardstickError(f"not executable: {binary}")
    return binary


@dataclass
class ServerSetup:
    """What both servers are given, and the load they get."""

    gguf: Path
    llama_server: Path
    parallel: int = 4  # slots
    ctx: int = 1024  # cells per slot
    threads: int = 2
    cache_type: str = "f16"  # both servers' KV cells (llama.cpp's names)
    cache_reuse: int = 256  # smallest reused chunk, tokens
    weights: str = "auto"  # ours' --weights
    clients: int = 8
    requests: int = 6  # per client
    max_tokens: int = 64  # every load reply runs to this many tokens
    turns: int = 30  # trimmed-chat turns (0: none)
    logs: Path | None = None  # the servers' output (None: a folder of this run's own, made here)
    llama_env: dict[str, str] | None = None  # llama-server's environment (None: this process's)

    def __post_init__(self) -> None:
        """Every count checked (:class:`~selfextend.core.validate.ValidationError`), as the CLI does."""
        lowest = {"parallel": 1, "ctx": 16, "threads": 1, "cache_reuse": 0}
        lowest.update(clients=1, requests=1, max_tokens=1)
        for name, lo in lowest.items():
            setattr(self, name, check_int(getattr(self, name), name, lo))
        self.turns = check_int(self.turns, "turns", 0, len(TOPICS))
        if self.logs is None:  # one folder per run: concurrent runs never write over each other's logs
            self.logs = Path(tempfile.mkdtemp(prefix="selfextend-bench-server-"))


def gguf_tokenizer(gguf: Path):
    """The GGUF's own tokenizer (transformers reads it from the file), for the trimmed chat's token budget:
    the client trims the same way for both servers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it before a server binds it: see
    :func:`start_on_a_free_port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BIND_FAILED = ("address already in use", "bind")  # what a server that lost its port says, lower case


def start_on_a_free_port(
    name: str, setup: ServerSetup, log: Path, env: dict | None = None, attempts: int = 3
) -> tuple[subprocess.Popen, str]:
    """Server ``name`` started on a port free a moment before (:func:`start`), again on another one if it
    exits saying it could not bind (the port taken between the pick and its bind), up to ``attempts``
    times: (the process, its base URL)."""
    for attempt in range(attempts):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        try:
            return start(command(name, setup, port), base, log, env), base
        except RuntimeError as e:
            if attempt == attempts - 1 or not any(word in str(e).lower() for word in BIND_FAILED):
                raise
    raise AssertionError("unreachable")


def command(name: str, setup: ServerSetup, port: int) -> list[str]:
    """The command line that serves ``setup.gguf`` on ``port``. llama-server's ``-c`` is the whole KV pool,
    split evenly over the slots when it is not unified."""
    s = setup
    if name == "llama-server":
        return [
            *(str(s.llama_server), "-m", str(s.gguf), "--host", "127.0.0.1", "--port", str(port)),
            *("-np", str(s.parallel), "-c", str(s.parallel * s.ctx), "--no-kv-unified"),
            *("-t", str(s.threads), "-tb", str(s.threads), "--cache-reuse", str(s.cache_reuse)),
            *("-ctk", s.cache_type, "-ctv", s.cache_type, "--no-webui"),
        ]
    return [
        *(sys.executable, "-m", "selfextend", "serve", "-m", str(s.gguf), "--port", str(port)),
        *("--parallel", str(s.parallel), "--ctx", str(s.ctx), "--threads", str(s.threads)),
        *("--cache-reuse", str(s.cache_reuse), "--cache-type", s.cache_type, "--weights", s.weights),
    ]


def start(
    cmd: list[str], base: str, log: Path, env: dict | None = None, timeout: float = 900
) -> subprocess.Popen:
    """Start a server with ``env`` (None: this process's) and its output in ``log``; return once ``/health``
    answers 200. Raises RuntimeError (with the log's tail) if it exits first, TimeoutError if it never
    answers."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"{Path(cmd[0]).name} exited with {proc.returncode}: {' | '.join(tail)}")
        try:
            if get(base, "/health", timeout=2) == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.25)
    proc.kill()
    proc.wait()
    raise TimeoutError(f"no server at {base} after {timeout:.0f} s (its output: {log})")


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL after a minute; the exit status."""
    proc.terminate()
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def measure(name: str, setup: ServerSetup, tokenizer, round_: int) -> list[dict]:
    """One server's records for one round: the load phase and (with ``setup.turns``) the trimmed chat."""
    weights = setup.weights if name == "selfextend" else "gguf"
    settings = {"case": "server", "server": name, "round": round_, "model": setup.gguf.name}
    settings.update(parallel=setup.parallel, ctx_per_slot=setup.ctx, threads=setup.threads)
    settings.update(cache_reuse=setup.cache_reuse, cache_type=setup.cache_type, weights=weights)
    assert setup.logs is not None  # made by __post_init__
    log = setup.logs / f"{name}.round{round_}.log"
    env = setup.llama_env if name == "llama-server" else None
    proc, base = start_on_a_free_port(name, setup, log, env)
    try:
        run_phase(base, 1, 1, max_tokens=8)  # warm-up, not recorded
        load = run_phase(base, setup.clients, setup.requests, setup.max_tokens, full=True, same_history=True)
        load.update(settings, phase="load", clients=setup.clients, max_tokens=setup.max_tokens)
        load["rss_end_mib"] = round(psutil.Process(proc.pid).memory_info().rss / 2**20, 1)
        records = [load]
        if setup.turns:
            rows = conversation(base, tokenizer, True, setup.turns, SAME_REPLY)
            first, median = trimmed_median(rows)
            chat = {**settings, "phase": "trimmed_chat", "turns": len(rows), "first_trimmed_turn": first}
            chat.update(ttft_median_s=round(median, 3), ttft_s=[r["ttft_s"] for r in rows])
            chat["computed_tokens"] = [r["computed_tokens"] for r in rows]
            records.append(chat)
    finally:
        stop(proc)
    for r in records:
        r["load_average_1m"] = round(psutil.getloadavg()[0], 2)
    return records


# what each round compares, ours over theirs: (phase, field)
COMPARED = (
    ("load", "aggregate_tokens_per_second"),
    ("load", "ttft_p50_s"),
    ("load", "ttft_p95_s"),
    ("trimmed_chat", "ttft_median_s"),
)


def ratios(records: list[dict]) -> dict[str, float]:
    """Ours over llama-server's for one round's records, per :data:`COMPARED` field both have (a time's
    ratio below 1 and a rate's above 1 are ours ahead)."""
    by = {(r["server"], r["phase"]): r for r in records}
    out = {}
    for phase, key in COMPARED:
        ours, theirs = (
            by.get(("selfextend", phase), {}).get(key),
            by.get(("llama-server", phase), {}).get(key),
        )
        if ours is not None and theirs:
            out[key] = round(ours / theirs, 3)
    return out


def rounds(setup: ServerSetup, tokenizer, repeats: int) -> Iterator[tuple[int, list[dict], dict]]:
    """``repeats`` rounds, each running both servers in turn, the first alternating (ours first in round 0):
    (round, its records, :func:`ratios`) per round."""
    for round_ in range(repeats):
        order = SERVERS if round_ % 2 == 0 else SERVERS[::-1]
        records = [r for name in order for r in measure(name, setup, tokenizer, round_)]
        yield round_, records, ratios(records)
