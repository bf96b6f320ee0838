"""A bounded loopback load test of ``selfextend serve --parallel 4`` on the default model.

First one client alone (10 streaming requests: aggregate tokens/s at 1 client), then 4 clients x 10
requests (at 4 clients: the 4 slots decode together), then 8 concurrent streaming clients x 25 requests
each, every client with its own short conversation (its prompts share a prefix, so slots get reused).
Checks: every request completes or gets a clean 4xx error body, no 5xx; the server's resident memory
(RSS) at the end within 5% of what it was after the first 10 requests of the load phase (RSS is also
recorded after every 10 requests, to see where it grows). Reports p50/p95 time to first token (client
side, queueing included) and aggregate tokens/s. Loopback only, bounded in count; writes
experiments/server/results/server_load.json (``--out``). ``--env NAME=VALUE`` sets a variable for the server
(allocator experiments: ``MALLOC_ARENA_MAX=2``), ``--requests`` shortens the load phase.

    python experiments/server/server_load.py   # ~10-15 minutes on a 2-core CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from server_util import free_port, wait_healthy  # noqa: E402

OUT = Path(__file__).parent / "results" / "server_load.json"
CLIENTS, REQUESTS, PARALLEL, CTX, MAX_TOKENS = 8, 25, 4, 1024, 24
SAME_REPLY = (  # client_loop's stand-in for every reply with same_history (about 60 tokens)
    "Blue things, briefly: the sky on a clear afternoon, the deep sea far from the shore, a sapphire "
    "set in a ring, cornflowers in a summer field, a robin's egg, denim jeans, and the ink of an old "
    "fountain pen."
)


def one_request(
    client: openai.OpenAI, messages: list[dict], max_tokens: int = MAX_TOKENS, full: bool = False
) -> dict:
    """One streaming chat request; ``full``: every reply runs to ``max_tokens`` (``ignore_eos``, which
    llama-server takes too), so that servers compare on equal work."""
    t0 = time.perf_counter()
    ttft, text, tokens, prompt, cached = None, "", 0, 0, 0
    try:
        stream = client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if full else None,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.usage:
                tokens, prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details else 0
    except openai.APIStatusError as e:
        return {"status": e.status_code, "error": e.message, "seconds": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    return {
        "status": 200,
        "ttft": ttft,
        "tokens": tokens,
        "prompt": prompt,
        "cached": cached,
        "text": text,
        "seconds": seconds,
    }


def client_loop(
    base: str,
    index: int,
    count: int,
    results: list,
    done: list,
    max_tokens: int = MAX_TOKENS,
    full: bool = False,
    same_history: bool = False,
) -> None:
    """``same_history``: each reply enters the conversation as :data:`SAME_REPLY`, not as the server wrote it,
    so that every server is sent the same prompts (a model with synthetic weights writes text whose length
    in tokens differs by server, and with it the prompt work)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    history = [{"role": "system", "content": f"You are assistant number {index}. Be brief."}]
    for i in range(count):
        history.append({"role": "user", "content": f"Question {i}: name something blue, number {i}."})
        r = one_request(client, history[-7:] if len(history) > 7 else history, max_tokens, full)
        history.append({"role": "assistant", "content": SAME_REPLY if same_history else r.get("text", "")})
        r["client"] = index
        results.append(r)
        done.append(1)


def summary(results: list[dict], seconds: float) -> dict:
    ok = [r for r in results if r["status"] == 200]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    tokens = sum(r["tokens"] for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "4xx": sum(400 <= r["status"] < 500 for r in results),
        "5xx": sum(r["status"] >= 500 for r in results),
        "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_p95_s": round(ttfts[int(0.95 * (len(ttfts) - 1))], 3) if ttfts else None,
        "completion_tokens": tokens,
        "prompt_tokens": sum(r["prompt"] for r in ok),  # each server's own count: replies differ in length
        "cached_prompt_tokens": sum(r["cached"] for r in ok),
        "seconds": round(seconds, 1),
        "aggregate_tokens_per_second": round(tokens / seconds, 2),
    }


def rss_parts(pid: int) -> dict[str, float]:
    """The server's resident memory by kind (Linux): anonymous (heaps, tensors made at run time) and
    file-backed (pages of memory-mapped weight files, resident once touched), MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {k: round(int(fields[k].split()[0]) / 1024, 1) for k in ("RssAnon", "RssFile") if k in fields}


class RssProbe:
    """The server's RSS in bytes when called; ``pid`` for :func:`rss_parts`."""

    def __init__(self, process: psutil.Process) -> None:
        self.process, self.pid = process, process.pid

    def __call__(self) -> int:
        return self.process.memory_info().rss


def run_phase(
    base: str,
    clients: int,
    count: int,
    rss_probe=None,
    max_tokens: int = MAX_TOKENS,
    full: bool = False,
    same_history: bool = False,
) -> dict:
    """``clients`` conversations of ``count`` requests of at most ``max_tokens`` (``full``: exactly) at once
    (``same_history``: :func:`client_loop`'s); with ``rss_probe``, the server's RSS after the first 10
    requests, after every 10 more and at the end."""
    results: list[dict] = []
    done: list[int] = []
    threads = [
        threading.Thread(
            target=client_loop, args=(base, i, count, results, done, max_tokens, full, same_history)
        )
        for i in range(clients)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    rss: dict[int, float] = {}  # requests done -> RSS in MiB
    parts: dict[int, dict[str, float]] = {}  # requests done -> anonymous and file-backed RSS in MiB
    while any(t.is_alive() for t in threads):
        if rss_probe and len(done) >= 10 * (len(rss) + 1):
            rss[len(done)] = round(rss_probe() / 2**20, 1)
            parts[len(done)] = rss_parts(rss_probe.pid)
        time.sleep(0.2)
    out = summary(results, time.perf_counter() - t0)
    if rss_probe:
        out["rss_after_10_mib"] = next(iter(rss.values()))
        out["rss_end_mib"] = round(rss_probe() / 2**20, 1)
        out["rss_growth_percent"] = round(100 * (out["rss_end_mib"] / out["rss_after_10_mib"] - 1), 2)
        out["rss_mib_by_requests_done"] = rss
        out["rss_parts_mib_by_requests_done"] = parts
        out["rss_parts_end_mib"] = rss_parts(rss_probe.pid)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server process")
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests per client under load")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    env = {**os.environ, **dict(e.split("=", 1) for e in args.env)}
    port = free_port()
    cmd = [sys.executable, "-m", "selfextend", "serve", "--port", str(port), "--ctx", str(CTX)]
    proc = subprocess.Popen([*cmd, "--parallel", str(PARALLEL)], stderr=subprocess.PIPE, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    server = psutil.Process(proc.pid)
    try:
        wait_healthy(base, 600, proc)
        single = run_phase(base, 1, 10)
        print("1 client:", json.dumps(single), flush=True)
        four = run_phase(base, PARALLEL, 10)
        print(f"{PARALLEL} clients:", json.dumps(four), flush=True)
        load = run_phase(base, CLIENTS, args.requests, RssProbe(server))
        print(f"{CLIENTS} clients:", json.dumps(load), flush=True)
    finally:
        proc.terminate()
        code = proc.wait(180)
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
