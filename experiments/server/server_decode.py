"""Does ``selfextend serve`` decode as fast as ``selfextend generate``? Side by side, interleaved rounds.

Each round: ``generate`` writes ``--tokens`` tokens after a short prompt (the rate from its summary
line), then every server variant answers the same request (non-streaming, ``ignore_eos``; the rate is
the server's own ``selfextend.tokens_per_second``, so the client's share of the CPU is not in it), once
with the default sampling and once greedy. Servers are started once and are idle while the others run.
A variant is ``NAME`` or ``NAME:VAR=VALUE,...`` (environment for that server: allocator settings such as
``MALLOC_MMAP_THRESHOLD_=65536``). ``--concurrent 2,4`` also sends that many requests at once (the
servers run ``--parallel`` the largest) and records their aggregate rate: tokens of all of them over the
wall-clock time from the first sent to the last answered. Run it from another checkout's environment to
time that code:

    python experiments/server/server_decode.py --model gemma3-270m --rounds 3 \
        --variant default --variant small-mmap:MALLOC_MMAP_THRESHOLD_=65536,MALLOC_TRIM_THRESHOLD_=131072

Writes one JSON line per measurement and a summary per setting (median, min, max, ratio to generate
per round) to ``--out`` (default ``experiments/server/results/server_decode.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from server_util import free_port, request, wait_healthy  # noqa: E402

OUT = Path(__file__).parent / "results" / "server_decode.jsonl"
PROMPT = "Once upon a time"
SAMPLINGS = {"default": {}, "greedy": {"temperature": 0}}


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, env = text.partition(":")
    return name, dict(item.split("=", 1) for item in env.split(",") if item)


def generate_rate(model: str, tokens: int, ctx: int, greedy: bool) -> float:
    args = ["generate", "-m", model, "-p", PROMPT, "-n", str(tokens), "--ignore-eos", "--ctx", str(ctx)]
    args += ["--temperature", "0"] if greedy else []
    r = subprocess.run(
        [sys.executable, "-m", "selfextend", *args], capture_output=True, text=True, check=True
    )
    return float(re.search(r"\(([\d.]+) tokens/s\)", r.stderr).group(1))


def server_rate(base: str, tokens: int, sampling: dict) -> float:
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, **sampling}
    status, answer = request(base, "POST", "/v1/completions", body, timeout=600)
    if status != 200:
        raise RuntimeError(f"{status}: {answer}")
    return answer["selfextend"]["tokens_per_second"]


def aggregate_rate(base: str, tokens: int, sampling: dict, n: int) -> float:
    """Tokens per second of ``n`` requests sent at once (each its own prompt), all of them together."""
    errors: list[Exception] = []
    written: list[int] = []

    def one(i: int) -> None:
        body = {"prompt": f"{PROMPT} ({i})", "max_tokens": tokens, "ignore_eos": True, **sampling}
        status, answer = request(base, "POST", "/v1/completions", body, timeout=600)
        if status != 200:
            errors.append(RuntimeError(f"{status}: {answer}"))
        else:
            written.append(
                answer["usage"]["completion_tokens"]
            )  # fewer at an EOS where ignore_eos is unknown

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(written) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], help="NAME or NAME:VAR=VALUE,...")
    parser.add_argument("--concurrent", default="", help="e.g. 2,4: also that many requests at once")
    parser.add_argument("--label", default="", help="recorded with every line (which checkout ran)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant or ["default"]]
    concurrent = [int(c) for c in args.concurrent.split(",") if c]
    parallel = str(max([1, *concurrent]))
    servers = {}
    try:
        for name, env in variants:
            port = free_port()
            cmd = [sys.executable, "-m", "selfextend", "serve", "-m", args.model, "--ctx", str(args.ctx)]
            proc = subprocess.Popen(
                [*cmd, "--port", str(port), "--parallel", parallel],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, **env},
            )
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base, 600, proc)
            servers[name] = (base, proc)
        rows = []
        for rnd in range(args.rounds):
            for sampling, fields in SAMPLINGS.items():
                ours = generate_rate(args.model, args.tokens, args.ctx, greedy=bool(fields))
                rows.append({"round": rnd, "sampling": sampling, "setting": "generate", "tokens_per_s": ours})
                for name, (base, _) in servers.items():
                    rate = server_rate(base, args.tokens, fields)
                    rows.append(
                        {"round": rnd, "sampling": sampling, "setting": f"serve {name}", "tokens_per_s": rate}
                    )
                    print(
                        f"round {rnd} {sampling}: generate {ours:.1f}, serve {name} {rate:.1f} tok/s",
                        flush=True,
                    )
                    for n in concurrent:
                        rate = aggregate_rate(base, args.tokens, fields, n)
                        setting = f"serve {name} x{n}"
                        rows.append(
                            {"round": rnd, "sampling": sampling, "setting": setting, "tokens_per_s": rate}
                        )
                        print(f"round {rnd} {sampling}: {setting} {rate:.1f} tok/s together", flush=True)
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(60)
    meta = {"model": args.model, "tokens": args.tokens, "ctx": args.ctx, "parallel": int(parallel)}
    meta["label"] = args.label
    summary = []
    for sampling in SAMPLINGS:
        gen = {
            r["round"]: r["tokens_per_s"]
            for r in rows
            if r["sampling"] == sampling and r["setting"] == "generate"
        }
        for setting in dict.fromkeys(r["setting"] for r in rows):
            rates = [r for r in rows if r["sampling"] == sampling and r["setting"] == setting]
            values = [r["tokens_per_s"] for r in rates]
            ratios = [r["tokens_per_s"] / gen[r["round"]] for r in rates]
            line = {
                "summary": True,
                "sampling": sampling,
                "setting": setting,
                "median_tokens_per_s": round(statistics.median(values), 1),
                "min": round(min(values), 1),
                "max": round(max(values), 1),
                "ratio_to_generate_per_round": [round(x, 2) for x in ratios],
            }
            summary.append(line)
            print(json.dumps(line))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for row in rows + summary:
            f.write(json.dumps({**meta, **row}) + "\n")


if __name__ == "__main__":
    main()
