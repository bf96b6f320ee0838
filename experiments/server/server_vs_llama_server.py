"""Side by side under load (issue 28): llama.cpp's own ``llama-server`` and ``selfextend serve`` on the same
GGUF, the same slots, the same cells per slot and the same threads, one server at a time on loopback.

Each server gets one warm-up request, then the same bounded streaming load (``server_load.run_phase``:
``--clients`` conversations of ``--requests`` requests of at most ``--max-tokens`` tokens at once; with
``--full-replies`` every reply runs to ``--max-tokens``, so that the servers do the same work; with
``--same-history`` each reply, here and in the trimmed chat, enters its conversation as one fixed text, so
that they get the same prompts, which a model with synthetic weights needs), then the
scripted chat trimmed from the front (``server_trimmed_chat.conversation``, cache reuse on; llama-server
with ``--cache-reuse`` of the same chunk size as ours). Rounds alternate which server goes first. Writes
one JSON line per server, round and phase to experiments/server/results/server_vs_llama_server.jsonl
(``--out``, appended; the servers' own output goes to server_vs_llama_server.<name>.log in the temp
folder) and prints ours / llama-server's per round: aggregate tokens/s (higher is better for us), TTFT
p50 / p95 and the trimmed chat's median TTFT from its first trimmed turn on (lower is better for us).

    python experiments/server/server_vs_llama_server.py --clients 8 --requests 6 --max-tokens 64
    python experiments/server/server_vs_llama_server.py --rounds 2 --full-replies
    python experiments/server/server_vs_llama_server.py \
        -m /work/llama/models/llama-3.2-1b-synthetic-Q4_K_M.gguf --full-replies --same-history \
        --requests 3 --turns 14
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from server_load import SAME_REPLY, run_phase  # noqa: E402
from server_trimmed_chat import TOPICS, conversation  # noqa: E402
from server_util import free_port, request  # noqa: E402

from selfextend.evaluation.results import append_jsonl  # noqa: E402
from selfextend.models import resolve_model  # noqa: E402

OUT = Path(__file__).parent / "results" / "server_vs_llama_server.jsonl"
LLAMA_SERVER = Path("/work/llama/bin/llama-server")
SERVERS = ("llama-server", "selfextend")


def command(name: str, args: argparse.Namespace, gguf: Path, port: int) -> list[str]:
    """The command line that serves ``gguf`` on ``port`` with ``args``' slots, cells per slot and threads.
    llama-server's ``-c`` is the whole KV pool, split evenly over the slots when it is not unified."""
    if name == "llama-server":
        return [
            *(str(args.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
            *("-np", str(args.parallel), "-c", str(args.parallel * args.ctx), "--no-kv-unified"),
            *("-t", str(args.threads), "-tb", str(args.threads), "--cache-reuse", str(args.cache_reuse)),
            *("-ctk", args.cache_type, "-ctv", args.cache_type, "--no-webui"),
        ]
    return [
        *(sys.executable, "-m", "selfextend", "serve", "-m", str(gguf), "--port", str(port)),
        *("--parallel", str(args.parallel), "--ctx", str(args.ctx), "--threads", str(args.threads)),
        *("--cache-reuse", str(args.cache_reuse), "--cache-type", args.cache_type, "--weights", args.weights),
    ]


def start(cmd: list[str], base: str, log: Path, env: dict, timeout: float = 900) -> subprocess.Popen:
    """Start a server with ``env`` and its output in ``log``; return once /health answers 200 (a one-line
    error with the log's tail if it exits or never gets there)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if request(base, "GET", "/health", timeout=2)[0] == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"no server at {base} after {timeout:.0f} s: {log.read_text()[-2000:]}")


def trimmed_median(rows: list[dict]) -> tuple[int, float]:
    """The first turn whose history was trimmed, and the median TTFT from that turn on (seconds)."""
    first = next((r["turn"] for r in rows if r["dropped_exchanges"]), rows[-1]["turn"])
    return first, statistics.median(r["ttft_s"] for r in rows if r["turn"] >= first)


def measure(name: str, args: argparse.Namespace, gguf: Path, tok, round_: int) -> list[dict]:
    """One server's rows for one round: the load phase and the trimmed chat."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    settings = {"server": name, "round": round_, "model": gguf.name, "parallel": args.parallel}
    settings.update(ctx_per_slot=args.ctx, threads=args.threads, cache_reuse=args.cache_reuse)
    weights = args.weights if name == "selfextend" else "gguf"
    settings.update(server_env=args.env, cache_type=args.cache_type, weights=weights)
    log = Path(tempfile.gettempdir()) / f"server_vs_llama_server.{name}.log"
    env = {**os.environ, **dict(e.split("=", 1) for e in args.env)}
    proc = start(command(name, args, gguf, port), base, log, env)
    try:
        run_phase(base, 1, 1, max_tokens=8)  # warm-up, not recorded
        load = run_phase(
            base,
            args.clients,
            args.requests,
            max_tokens=args.max_tokens,
            full=args.full_replies,
            same_history=args.same_history,
        )
        load.update(settings, phase="load", clients=args.clients, max_tokens=args.max_tokens)
        load.update(full_replies=args.full_replies, same_history=args.same_history)
        load["rss_end_mib"] = round(psutil.Process(proc.pid).memory_info().rss / 2**20, 1)
        print(json.dumps(load), flush=True)
        rows = conversation(base, tok, True, name, args.turns, SAME_REPLY if args.same_history else None)
        first, median = trimmed_median(rows)
        chat = {**settings, "phase": "trimmed_chat", "turns": len(rows), "first_trimmed_turn": first}
        chat.update(ttft_median_s=round(median, 3), ttft_s=[r["ttft_s"] for r in rows])
        chat["computed_tokens"] = [r["computed_tokens"] for r in rows]
    finally:
        proc.terminate()
        proc.wait(180)
    chat["load_average_1m"] = load["load_average_1m"] = round(psutil.getloadavg()[0], 2)
    return [load, chat]


def ratios(rows: list[dict]) -> dict[str, float]:
    """Ours over llama-server's, for one round's rows."""
    by = {(r["server"], r["phase"]): r for r in rows}
    ours, theirs = by["selfextend", "load"], by["llama-server", "load"]
    rate = "aggregate_tokens_per_second"
    out = {"aggregate_tokens_per_s": ours[rate] / theirs[rate]}
    for key in ("ttft_p50_s", "ttft_p95_s"):
        out[f"{key} (time)"] = ours[key] / theirs[key]
    chats = [by[name, "trimmed_chat"]["ttft_median_s"] for name in ("selfextend", "llama-server")]
    out["trimmed_chat_ttft_median (time)"] = chats[0] / chats[1]
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m", help="a .gguf file or the alias of one")
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER, help="the llama-server binary")
    ap.add_argument("--parallel", type=int, default=4, help="slots")
    ap.add_argument("--ctx", type=int, default=1024, help="cells per slot")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-type", default="f16", help="KV cell type, both (llama.cpp's names: f16, bf16)")
    ap.add_argument("--weights", default="auto", help="selfextend serve's --weights (auto, gguf, int4)")
    ap.add_argument("--cache-reuse", type=int, default=256, help="smallest reused chunk (tokens), both")
    ap.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    ap.add_argument("--requests", type=int, default=6, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each load request")
    ap.add_argument(
        "--full-replies",
        action="store_true",
        help="every load reply runs to --max-tokens (ignore_eos): both servers do the same work",
    )
    ap.add_argument(
        "--same-history",
        action="store_true",
        help="each reply (load and trimmed chat) enters its conversation as one fixed text: both servers get "
        "the same prompts (synthetic weights write replies of different token lengths per server)",
    )
    ap.add_argument("--turns", type=int, default=len(TOPICS), help="turns of the trimmed chat")
    ap.add_argument("--rounds", type=int, default=1, help="rounds; each alternates which server goes first")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for both servers' processes")
    ap.add_argument("--out", type=Path, default=OUT, help="JSON Lines, appended")
    args = ap.parse_args()
    gguf = resolve_model(args.model).gguf_path
    if gguf is None or not args.llama_server.exists():
        sys.exit(f"error: needs a GGUF model ({args.model}) and llama-server ({args.llama_server})")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for round_ in range(args.rounds):
        rows = []
        for name in SERVERS if round_ % 2 == 0 else SERVERS[::-1]:
            rows += measure(name, args, gguf, tok, round_)
        for r in rows:
            append_jsonl(args.out, r)
        print(f"round {round_}, ours / llama-server: {json.dumps(ratios(rows))}", flush=True)


if __name__ == "__main__":
    main()
