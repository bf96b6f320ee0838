"""A bounded loopback load test of ``selfextend serve --parallel 4`` on the default model.

First one client alone (10 streaming requests: aggregate tokens/s at 1 client), then 4 clients x 10
requests (at 4 clients: the 4 slots decode together), then 8 concurrent streaming clients x 25 requests
each, every client with its own short conversation (its prompts share a prefix, so slots get reused).
Checks: every request completes or gets a clean 4xx error body, no 5xx; the server's resident memory
(RSS) at the end within 5% of what it was after the first 10 requests of the load phase (RSS is also
recorded after every 10 requests, to see where it grows). Reports p50/p95 time to first token (client
side, queueing included) and aggregate tokens/s. Loopback only, bounded in count; writes
experiments/server/results/server_load.json (``--out``). ``--env NAME=VALUE`` sets a variable for the server
(allocator experiments: ``MALLOC_ARENA_MAX=2``), ``--requests`` shortens the load phase. The clients are
``selfextend bench``'s (:mod:`selfextend.bench.clients`; ``selfextend bench --cases server`` runs the same
load against llama-server too).

    python experiments/server/server_load.py   # ~10-15 minutes on a 2-core CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import psutil

from selfextend.bench.clients import run_phase
from selfextend.bench.servers import free_port, start, stop

OUT = Path(__file__).parent / "results" / "server_load.json"
CLIENTS, REQUESTS, PARALLEL, CTX, MAX_TOKENS = 8, 25, 4, 1024, 24


def rss_parts(pid: int) -> dict[str, float]:
    """The server's resident memory by kind (Linux): anonymous (heaps, tensors made at run time) and
    file-backed (pages of memory-mapped weight files, resident once touched), MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {k: round(int(fields[k].split()[0]) / 1024, 1) for k in ("RssAnon", "RssFile") if k in fields}


def load_phase(base: str, clients: int, count: int, pid: int) -> dict:
    """:func:`~selfextend.bench.clients.run_phase` with the server's RSS after the first 10 requests, after
    every 10 more and at the end (MiB; anonymous and file-backed parts too)."""
    process = psutil.Process(pid)
    rss: dict[int, float] = {}  # requests done -> RSS in MiB
    parts: dict[int, dict[str, float]] = {}

    def probe(done: int) -> None:
        rss[done] = round(process.memory_info().rss / 2**20, 1)
        parts[done] = rss_parts(pid)

    out = run_phase(base, clients, count, MAX_TOKENS, every_10=probe)
    out["rss_after_10_mib"] = next(iter(rss.values()))
    out["rss_end_mib"] = round(process.memory_info().rss / 2**20, 1)
    out["rss_growth_percent"] = round(100 * (out["rss_end_mib"] / out["rss_after_10_mib"] - 1), 2)
    out["rss_mib_by_requests_done"] = rss
    out["rss_parts_mib_by_requests_done"] = parts
    out["rss_parts_end_mib"] = rss_parts(pid)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server process")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests per client under load")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **dict(e.split("=", 1) for e in args.env)}
    port = free_port()
    cmd = [sys.executable, "-m", "selfextend", "serve", "--port", str(port), "--ctx", str(CTX)]
    base = f"http://127.0.0.1:{port}"
    log = Path(tempfile.gettempdir()) / "server_load.log"  # the server's own output
    proc = start([*cmd, "--parallel", str(PARALLEL)], base, log, env)
    try:
        single = run_phase(base, 1, 10, MAX_TOKENS)
        print("1 client:", json.dumps(single), flush=True)
        four = run_phase(base, PARALLEL, 10, MAX_TOKENS)
        print(f"{PARALLEL} clients:", json.dumps(four), flush=True)
        load = load_phase(base, CLIENTS, args.requests, proc.pid)
        print(f"{CLIENTS} clients:", json.dumps(load), flush=True)
    finally:
        code = stop(proc)
    result = {
        "parallel": PARALLEL,
        "ctx": CTX,
        "max_tokens": MAX_TOKENS,
        "server_env": args.env,
        "one_client": single,
        f"{PARALLEL}_clients": four,
        "load": load,
        "exit_code_after_sigterm": code,
        "load_average_1m_at_end": round(psutil.getloadavg()[0], 2),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
