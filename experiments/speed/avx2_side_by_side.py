"""Ours against a llama.cpp build of the user's choice (llama-bench), rounds interleaved: decode and prompts.

Issue 41 asks for the speeds of the CPUs most people have: AVX2, no AVX-512, no AMX. On a machine with
AVX-512 both sides can be built as such a CPU runs them: ours with ``SELFEXTEND_NATIVE_FLAGS=-mno-avx512f``
(``--flags``), llama.cpp built with ``GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF`` (``--llama-bench``; the
commands are in docs/bench.md). The memory is the machine's either way, so the decode rates read against
the same bandwidth.

Each round runs, in turn: ``selfextend bench --cases generate`` (``--forms gguf``: our step plain and with
Self-Extend G=4 W=1024, from a prompt of ``--ctx``/2 tokens, ``--tokens`` greedy tokens; it also times
llama-cpp-python's own build when that is installed, reported as a third column) then ``llama-bench -p 0
-n TOKENS -d CTX/2`` (the same decode from the same depth, f16 cells: llama.cpp's default); then, with
``--prompt N``, ``selfextend bench --cases first-token --lengths N`` against ``llama-bench -p N -n 0``
(``--no-decode``: that alone, for long prompts). The order flips every round. Ratios are taken per round.

    python experiments/speed/avx2_side_by_side.py MODEL.gguf --llama-bench /path/avx2/llama-bench \\
        --flags=-mno-avx512f --rounds 2 --prompt 1024

Appends one JSON line per round and a summary to ``--out`` (default
``experiments/speed/results/avx2_side_by_side.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from selfextend.bench.speed import bandwidth_around

HERE = Path(__file__).resolve().parent


def cpu_times() -> list[int]:
    """The machine's CPU time so far in jiffies by kind (/proc/stat's first line: user, nice, system, idle,
    iowait, irq, softirq, steal, ...)."""
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


def stolen(run: Callable[[], object], into: dict, key: str) -> object:
    """``run()``, with the share of the machine's CPU time the hypervisor took meanwhile (steal) put in
    ``into[key]``: a round where the host took our cores reads differently from one where it took memory."""
    before = cpu_times()
    done = run()
    delta = [b - a for a, b in zip(before, cpu_times(), strict=True)]
    into[key] = delta[7] / max(1, sum(delta[:8]))
    return done


def ours(model: Path, case: str, args: argparse.Namespace) -> dict[str, dict]:
    """``selfextend bench``'s summary rows of one case, by variant."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.jsonl"
        cmd = [sys.executable, "-m", "selfextend", "bench", "-m", str(model), "--weights", "gguf"]
        cmd += ["--forms", "gguf", "-t", str(args.threads), "--cases", case, "--repeats", "1", "-o", str(out)]
        if case == "generate":
            cmd += ["--ctx", str(args.ctx), "--endless-tokens", str(args.tokens)]
        else:
            cmd += ["--lengths", str(args.prompt)]
        env = dict(os.environ, SELFEXTEND_NATIVE_FLAGS=args.flags) if args.flags else dict(os.environ)
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {r["variant"]: r for r in rows if r.get("summary")}


def llama_bench(model: Path, prompt: int, tokens: int, depth: int, args: argparse.Namespace) -> float:
    """llama-bench's tokens/s for one test (a prompt of ``prompt`` tokens, or ``tokens`` decoded at
    ``depth``)."""
    cmd = [str(args.llama_bench), "-m", str(model), "-p", str(prompt), "-n", str(tokens), "-d", str(depth)]
    cmd += ["-t", str(args.threads), "-r", "1", "-o", "json"]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return float(json.loads(done.stdout)[0]["avg_ts"])


def one_round(model: Path, flip: bool, args: argparse.Namespace) -> dict:
    row: dict = {}
    depth = args.ctx // 2

    def decode_ours() -> None:
        got = stolen(lambda: ours(model, "generate", args), row, "ours_steal")
        row["ours"] = got["gguf"]["tokens_per_s"]
        row["ours_selfextend"] = got["gguf+selfextend"]["tokens_per_s"]
        row["mb_per_token"] = got["gguf"]["mb_per_token"]
        row["read_bandwidth_gbs"] = got["gguf"].get("read_bandwidth_gbs")
        if "llama.cpp" in got:
            row["llama_cpp_python"] = got["llama.cpp"]["tokens_per_s"]
            row["llama_mb_per_token"] = got["llama.cpp"]["mb_per_token"]

    def decode_theirs() -> None:
        around: dict = {}
        with bandwidth_around(around):  # the probe just before and after llama-bench's run
            row["llama_bench"] = stolen(
                lambda: llama_bench(model, 0, args.tokens, depth, args), row, "llama_steal"
            )
        row["llama_read_bandwidth_gbs"] = around["read_bandwidth_gbs"]

    def prompt_ours() -> None:
        got = ours(model, "first-token", args)
        row["ours_prompt_s"] = got["gguf+selfextend"]["seconds"]
        if "llama.cpp" in got:
            row["llama_cpp_python_prompt_s"] = got["llama.cpp"]["seconds"]

    def prompt_theirs() -> None:
        row["llama_bench_prompt_s"] = args.prompt / llama_bench(model, args.prompt, 0, 0, args)

    steps = [(decode_ours, decode_theirs)] * (not args.no_decode)
    steps += [(prompt_ours, prompt_theirs)] * bool(args.prompt)
    for a, b in steps:
        for step in (b, a) if flip else (a, b):
            step()
    if not args.no_decode:
        row["decode_ratio"] = row["ours"] / row["llama_bench"]
        row["selfextend_ratio"] = row["ours_selfextend"] / row["llama_bench"]
        row["ours_gbs"] = row["ours"] * row["mb_per_token"] / 1e3
        row["ours_share"] = row["ours_gbs"] / row["read_bandwidth_gbs"][1]  # of the highest reading around it
    if args.prompt:
        row["prompt_rate_ratio"] = row["llama_bench_prompt_s"] / row["ours_prompt_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path, help="a GGUF file")
    parser.add_argument("--llama-bench", type=Path, required=True, help="llama.cpp's llama-bench binary")
    parser.add_argument("--flags", default="", help="SELFEXTEND_NATIVE_FLAGS for ours, e.g. -mno-avx512f")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=2048, help="cache cells; decode starts at ctx/2")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens timed")
    parser.add_argument("--prompt", type=int, default=0, help="also time a prompt of N tokens (0: no)")
    parser.add_argument("--no-decode", action="store_true", help="the prompt only (with --prompt)")
    parser.add_argument("--label", default="", help="a note kept with the rows (the CPU, the build)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "avx2_side_by_side.jsonl")
    args = parser.parse_args()
    if not args.model.is_file():
        parser.error(f"no such GGUF file: {args.model}")
    if not (args.llama_bench.is_file() and os.access(args.llama_bench, os.X_OK)):
        parser.error(f"not an executable llama-bench: {args.llama_bench}")
    if min(args.rounds, args.threads, args.tokens) < 1 or args.ctx < 2 or args.prompt < 0:
        parser.error("--rounds, --threads and --tokens must be at least 1, --ctx 2, --prompt 0")
    if args.no_decode and not args.prompt:
        parser.error("--no-decode leaves nothing to time without --prompt N")

    rows = []
    for r in range(args.rounds):
        row = one_round(args.model, r % 2 == 1, args)
        rows.append(row)
        said = f"round {r}:"
        if not args.no_decode:
            said += f" ours {row['ours']:.2f} tok/s ({row['ours_gbs']:.1f} GB/s"
            lo, hi = row["read_bandwidth_gbs"]
            said += f" of {lo:.1f}-{hi:.1f}), +SE {row['ours_selfextend']:.2f}, llama-bench"
            said += (
                f" {row['llama_bench']:.2f}: {row['decode_ratio']:.2f}x, SE {row['selfextend_ratio']:.2f}x"
            )
        if "llama_cpp_python" in row:
            said += f"; llama-cpp-python {row['llama_cpp_python']:.2f}"
        if not args.no_decode:
            said += f"; steal {row['ours_steal']:.1%} (ours), {row['llama_steal']:.1%} (llama-bench)"
        if args.prompt:
            said += f"; prompt {args.prompt}: ours {row['ours_prompt_s']:.1f} s, llama-bench"
            said += f" {row['llama_bench_prompt_s']:.1f} s: {row['prompt_rate_ratio']:.2f}x the rate"
        print(said, flush=True)
    keys = [k for k in ("decode_ratio", "selfextend_ratio", "prompt_rate_ratio") if k in rows[0]]
    summary = {k: statistics.median(r[k] for r in rows) for k in keys}
    print("median of rounds: " + ", ".join(f"{k} {v:.2f}x" for k, v in summary.items()))
    args.out.parent.mkdir(exist_ok=True)
    with args.out.open("a") as f:
        common = {"model": args.model.name, "flags": args.flags, "llama_bench": str(args.llama_bench)}
        common |= {"ctx": args.ctx, "tokens": args.tokens, "prompt": args.prompt, "label": args.label}
        for i, row in enumerate(rows):
            f.write(json.dumps({**common, "round": i, **row}) + "\n")
        f.write(json.dumps({**common, "summary": True, **summary}) + "\n")


if __name__ == "__main__":
    main()
