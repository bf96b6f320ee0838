"""Streaming chat clients for loading an OpenAI-compatible server (ours or llama.cpp's ``llama-server``):
one request read as server-sent events, and a phase of concurrent conversations with its summary.

Only the standard library's ``http.client`` (no client package): the yardstick measures the servers, so
the client side is the same plain code for both. Time to first token is measured here, queueing included.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

SAME_REPLY = (  # with same_history, every reply enters its conversation as this text (about 60 tokens)
    "Blue things, briefly: the sky on a clear afternoon, the deep sea far from the shore, a sapphire "
    "set in a ring, cornflowers in a summer field, a robin's egg, denim jeans, and the ink of an old "
    "fountain pen."
)


def get(base: str, path: str, timeout: float = 5) -> int:
    """The status of ``GET path`` on the server at ``base`` (``http://host:port``)."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def stream_chat(
    base: str,
    messages: list[dict],
    max_tokens: int,
    temperature: float = 0.7,
    extra: dict | None = None,
    timeout: float = 600,
) -> dict:
    """One streaming ``/v1/chat/completions`` request. Returns ``status``; with 200 also ``ttft`` (seconds to
    the first text, None if none came), ``text``, ``tokens`` (completion), ``prompt``, ``cached`` (prompt
    tokens the server found cached, 0 when it does not say), ``seconds`` and ``last`` (the final chunk's
    extra fields, such as ours' ``selfextend`` block); otherwise ``error``."""
    url = urlsplit(base)
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return {"status": response.status, "error": response.read()[:500].decode(errors="replace")}
        out = {"status": 200, "ttft": None, "text": "", "tokens": 0, "prompt": 0, "cached": 0, "last": {}}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            choice = (chunk.get("choices") or [{}])[0]
            content = (choice.get("delta") or {}).get("content")
            if content:
                out["ttft"] = out["ttft"] or time.perf_counter() - t0
                out["text"] += content
            if choice.get("finish_reason"):
                out["last"] = {k: v for k, v in chunk.items() if k not in ("choices", "usage")}
            if chunk.get("usage"):
                usage = chunk["usage"]
                out["tokens"], out["prompt"] = usage["completion_tokens"], usage["prompt_tokens"]
                out["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    finally:
        conn.close()
    out["seconds"] = time.perf_counter() - t0
    return out


def client_loop(
    base: str, index: int, count: int, results: list, max_tokens: int, full: bool, same_history: bool
) -> None:
    """One client's conversation of ``count`` requests, each sending the last 7 messages. ``full``: every
    reply runs to ``max_tokens`` (``ignore_eos``, which llama-server takes too); ``same_history``: each
    reply enters the history as :data:`SAME_REPLY`, so that every server is sent the same prompts (a model
    with synthetic weights writes replies whose token lengths differ by server)."""
    history = [{"role": "system", "content": f"You are assistant number {index}. Be brief."}]
    for i in range(count):
        history.append({"role": "user", "content": f"Question {i}: name something blue, number {i}."})
        r = stream_chat(base, history[-7:], max_tokens, extra={"ignore_eos": True} if full else None)
        history.append({"role": "assistant", "content": SAME_REPLY if same_history else r.get("text", "")})
        r["client"] = index
        results.append(r)


def summary(results: list[dict], seconds: float) -> dict:
    """Counts by status, TTFT p50/p95 (seconds), tokens and the aggregate tokens/s of one phase."""
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
        "prompt_tokens": sum(r["prompt"] for r in ok),  # each server's own count
        "cached_prompt_tokens": sum(r["cached"] for r in ok),
        "seconds": round(seconds, 1),
        "aggregate_tokens_per_second": round(tokens / seconds, 2),
    }


def run_phase(
    base: str,
    clients: int,
    count: int,
    max_tokens: int = 24,
    full: bool = False,
    same_history: bool = False,
    every_10: Callable[[int], None] | None = None,
) -> dict:
    """``clients`` conversations of ``count`` requests of at most ``max_tokens`` (``full``: exactly) at once;
    :func:`summary` of them. ``every_10(done)`` is called after every 10 requests done (a memory probe)."""
    results: list[dict] = []
    threads = [
        threading.Thread(target=client_loop, args=(base, i, count, results, max_tokens, full, same_history))
        for i in range(clients)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    probed = 0
    while any(t.is_alive() for t in threads):
        if every_10 and len(results) >= 10 * (probed + 1):
            probed += 1
            every_10(len(results))
        time.sleep(0.2)
    return summary(results, time.perf_counter() - t0)
