"""``selfextend serve --parallel 2`` under a lookup-friendly load, with and without ``--lookup N``, rounds
interleaved: aggregate completion tokens/s per round, their ratio, and every reply checked the same.

Why: ``serve --lookup`` drafts for each greedy slot and checks all slots' tokens and drafts in one pass of
the batched step; what that gains when several clients at once ask to copy or edit text (the case lookup is
for) is measured here, on a real loopback socket, against the same server without it. Each of
``--clients`` concurrent clients sends ``--requests`` greedy chat requests one after another (``max_tokens``
each, end of sequence ignored so both servers write the same number of tokens): a paragraph of Sherlock
Holmes (the default corpus) to repeat with a name changed, or a function of the standard library's
``textwrap`` to repeat renamed. A greedy reply does not depend on the slot, the batch it was decoded in or
the drafts (batch-invariant ``--weights gguf`` products), so every request's reply must be the same text
with and without lookup, in every round: checked and printed. With ``--draft FILE`` a third server runs
with ``--draft-model FILE`` (the option ``serve`` gets for speculative decoding with a draft model), and
each ``--draft-vocab N`` one more with ``--draft-vocab N``. With ``--llama-server PATH`` llama.cpp's server
takes the same load in the same rounds, plain and with ``--spec-type ngram-simple`` (3-grams, ``--lookup``
drafts; with ``--draft``, ``--model-draft`` too): the same slots, cells per slot and threads, f16 cells on
both sides (``--cache-type f16`` for ours). Its replies are compared with its own plain run's only (its
products are not batch-invariant).

    python experiments/server/lookup_load.py [--rounds 2] [--clients 4] [--requests 3] [--max-tokens 96]

Appends one JSON line per round to ``--out`` (default
``experiments/server/results/lookup_load.jsonl``), with the CPU model and the load average.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from selfextend.bench.clients import stream_chat, summary
from selfextend.bench.servers import free_port, start, stop
from selfextend.bench.speed import cpu_model, others_cpu, wait_for_quiet
from selfextend.evaluation.corpus import default_books
from selfextend.models.sources import resolve_model

HERE = Path(__file__).resolve().parent


def tasks(clients: int, requests: int, kinds: str = "both") -> list[list[str]]:
    """Each client's user messages, alternating (``kinds`` "both"; "copy" or "code": that kind alone): a
    paragraph of Sherlock Holmes (300-600 characters, naming
    Holmes) to repeat with his name changed, or a function (or method) of the standard library's
    ``textwrap`` to repeat renamed; every request a different text. Worded as the default model copies
    (asked to copy "exactly", it answers with the copy; asked to return or edit, it writes its own)."""
    paragraphs = [" ".join(p.split()) for p in default_books()["sherlock-holmes"].split("\n\n")]
    paragraphs = [p for p in paragraphs if 300 <= len(p) <= 600 and "Holmes" in p]
    functions = [*vars(textwrap).values(), *vars(textwrap.TextWrapper).values()]
    functions = [f for f in functions if inspect.isfunction(f) and len(inspect.getsource(f)) < 1200]
    out = []
    for c in range(clients):
        mine = []
        for r in range(requests):
            k = c * requests + r
            i = k // 2 if kinds == "both" else k  # each request its own text
            if kinds == "copy" or (kinds == "both" and k % 2 == 0):
                mine.append(
                    "Repeat this text exactly, word for word, but write 'Poirot' instead of 'Holmes':\n\n"
                    + paragraphs[i % len(paragraphs)]
                )
            else:
                f = functions[i % len(functions)]
                mine.append(
                    f"Repeat this Python code exactly, with the function `{f.__name__}` renamed to "
                    f"`{f.__name__}_v2`:\n\n```python\n{inspect.getsource(f)}```"
                )
        out.append(mine)
    return out


def client(base: str, messages: list[str], max_tokens: int) -> list[dict]:
    """One client's greedy requests, one after another."""
    out = []
    for text in messages:
        r = stream_chat(base, [{"role": "user", "content": text}], max_tokens, 0, {"ignore_eos": True})
        out.append(r)
    return out


def server_command(name: str, extra: list[str], port: int, args: argparse.Namespace) -> list[str]:
    """The command line of run ``name`` (``llama...``: llama-server; else ours) with ``extra`` flags."""
    if name.startswith("llama"):
        cmd = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-np", str(args.parallel), "-c", str(args.parallel * args.ctx), "--no-kv-unified"]
        cmd += ["-t", str(args.threads), "-tb", str(args.threads), "-ctk", "f16", "-ctv", "f16", "--no-webui"]
        return [*cmd, *extra]
    cmd = [sys.executable, "-m", "selfextend", "serve", "--port", str(port), "-m", args.model]
    cmd += ["--parallel", str(args.parallel), "--ctx", str(args.ctx), "--threads", str(args.threads)]
    cmd += ["--weights", "gguf", "--temperature", "0"]
    return cmd + (["--cache-type", "f16"] if args.llama_server else []) + extra


def serve_load(
    name: str, extra: list[str], work: list[list[str]], args: argparse.Namespace, log: Path
) -> dict:
    """Run ``name``'s server with ``extra`` flags under the whole load: the load's
    :func:`~selfextend.bench.clients.summary`, with every reply's text by (client, request)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start(server_command(name, extra, port, args), base, log)
    try:
        client(base, ["Say hi."], 4)  # warm-up, not recorded
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(work)) as pool:
            replies = list(pool.map(lambda m: client(base, m, args.max_tokens), work))
        seconds = time.perf_counter() - t0
    finally:
        stop(proc)
    out = summary([r for mine in replies for r in mine], seconds)
    out["texts"] = [[r.get("text") for r in mine] for mine in replies]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="smollm2-135m", help="a GGUF file or an alias naming one")
    parser.add_argument("--draft", type=Path, help="also a server with --draft-model FILE")
    parser.add_argument(
        "--draft-vocab", type=int, nargs="*", default=[], help="with --draft: also one with --draft-vocab N"
    )
    parser.add_argument("--llama-server", type=Path, help="also llama.cpp's server (this binary) on the load")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lookup", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=2, help="the server's slots")
    parser.add_argument("--ctx", type=int, default=1024, help="cells per slot")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=3, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per reply")
    parser.add_argument(
        "--kinds", choices=["both", "copy", "code"], default="both", help="the requests' kinds"
    )
    parser.add_argument("--quiet", type=float, default=0.25, help="wait for the CPU to be busy at most this")
    parser.add_argument("--quiet-wait", type=float, default=30, help="...for at most this many seconds")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "lookup_load.jsonl")
    args = parser.parse_args()
    if min(args.rounds, args.lookup, args.parallel, args.ctx, args.threads) < 1:
        parser.error("--rounds, --lookup, --parallel, --ctx and --threads must be at least 1")
    if min(args.clients, args.requests, args.max_tokens) < 1:
        parser.error("--clients, --requests and --max-tokens must be at least 1")
    if args.draft and not args.draft.is_file():
        parser.error(f"no such draft file: {args.draft}")
    if args.llama_server and not args.llama_server.is_file():
        parser.error(f"no such llama-server: {args.llama_server}")
    args.gguf = resolve_model(args.model).gguf_path
    runs = {"plain": [], f"lookup{args.lookup}": ["--lookup", str(args.lookup)]}
    if args.draft:
        runs["draft"] = ["--draft-model", str(args.draft)]
        for n in args.draft_vocab:
            runs[f"draft+vocab{n}"] = ["--draft-model", str(args.draft), "--draft-vocab", str(n)]
    if args.llama_server:
        runs["llama"] = []
        ngram = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"]
        runs["llama+ngram3"] = [*ngram, "--spec-ngram-simple-size-m", str(args.lookup)]
        if args.draft:
            runs["llama+draft"] = ["--spec-type", "draft-simple", "--model-draft", str(args.draft)]
    work = tasks(args.clients, args.requests, args.kinds)
    logs = Path(tempfile.mkdtemp(prefix="lookup-load-"))
    common = {"cpu": cpu_model(), "model": args.model, "draft": args.draft and args.draft.name}
    common["llama_server"] = args.llama_server and str(args.llama_server)
    common.update(parallel=args.parallel, ctx=args.ctx, threads=args.threads, lookup=args.lookup)
    common.update(clients=args.clients, requests=args.requests, max_tokens=args.max_tokens)
    print(f"CPU: {common['cpu']}; {args.clients} clients x {args.requests} requests; logs {logs}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    first_texts = None  # every reply of the first run: each later run must give the same
    for round_ in range(args.rounds):
        got = {}
        for name in list(runs)[::-1] if round_ % 2 else list(runs):
            seen = {"busy_before": round(wait_for_quiet(args.quiet, args.quiet_wait), 3)}  # others' tests
            with others_cpu(seen):
                got[name] = serve_load(name, runs[name], work, args, logs / f"{name}.round{round_}.log")
            got[name].update(seen)
        first_texts = first_texts or got["plain"]["texts"]
        row = {**common, "round": round_, "load_average_1m": round(psutil.getloadavg()[0], 2)}
        row["aggregate_tokens_per_second"] = {k: v["aggregate_tokens_per_second"] for k, v in got.items()}
        row["completion_tokens"] = {k: v["completion_tokens"] for k, v in got.items()}
        row["ok"] = {k: v["ok"] for k, v in got.items()}
        row["ttft_p50_s"] = {k: v["ttft_p50_s"] for k, v in got.items()}
        row["busy_before"] = {k: v["busy_before"] for k, v in got.items()}
        row["others_cpu"] = {k: v["others_cpu"] for k, v in got.items()}
        rate = row["aggregate_tokens_per_second"]
        row["ratio"] = {k: round(rate[k] / rate["plain"], 3) for k in rate if k != "plain"}
        for k in (k for k in rate if k.startswith("llama")):  # ours over llama-server's best, as a ratio
            row["ratio"][f"lookup{args.lookup}/{k}"] = round(rate[f"lookup{args.lookup}"] / rate[k], 3)
        llama_texts = got["llama"]["texts"] if "llama" in got else None
        row["identical"] = {
            k: v["texts"] == (llama_texts if k.startswith("llama") else first_texts) for k, v in got.items()
        }
        differ = [
            (c, r)
            for k, v in got.items()
            if not k.startswith("llama")
            for c, mine in enumerate(v["texts"])
            for r, text in enumerate(mine)
            if text != first_texts[c][r]
        ]
        row["differing_replies"] = sorted(set(differ))
        if round_ == 0:
            row["replies"] = first_texts  # what the model wrote, to see how much of it was a copy
        print(
            f"round {round_}: aggregate tok/s {rate}, over plain {row['ratio']}; every reply the same as the "
            f"first plain run's: {row['identical']}; others' CPU share {row['others_cpu']}, "
            f"load {row['load_average_1m']}",
            flush=True,
        )
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
