"""Decode rate with 1, 2 and the default threads, on an idle machine and beside a competing load: ours
(``selfextend generate``) against llama.cpp (llama-cpp-python, the same GGUF), issue 42 item 14.

Each row is a fresh process: ``selfextend generate`` on the default model (SmolLM2-135M Q4_1), 100 tokens,
greedy, ``--ignore-eos``, its rate read from the summary line; llama.cpp decodes 100 greedy tokens after the
same prompt's text through :class:`~selfextend.bench.llamacpp.LlamaCppGenerator` in its own process
(llama-cpp-python, the ``llamacpp`` extra). The load is this script's own: one pure-Python busy loop per
CPU this process may run on (:func:`os.sched_getaffinity`), started before the row and stopped after it
(bounded by ``--load-seconds`` in case this script dies), at the same priority as the row, as a build
beside it would be. Rounds interleave every row, idle and loaded.

Rows (``label``): ``ours default`` (what the CLI does when neither ``-t`` nor an OpenMP variable is set),
``ours -t 1``, ``ours -t 2``, ``ours before`` (libgomp's own default, spinning 300,000 rounds before a
worker sleeps: ``GOMP_SPINCOUNT=300000``, the CLI's default before 2026-11-27), ``ours passive`` (workers
sleep at once: ``OMP_WAIT_POLICY=PASSIVE``), ``llama.cpp -t 1``
(llama-cpp-python's default here: half the CPUs), ``llama.cpp -t 2`` (llama-cli's default: the cores)
and ``llama.cpp -t 2 passive`` (with ``OMP_WAIT_POLICY=PASSIVE``). llama.cpp's CPU
backend here is built with OpenMP too (libggml-cpu links libgomp), so the other ``llama.cpp`` rows run with
the environment this script was given (libgomp's defaults unless set).

The idle rows mean something only on an otherwise idle machine: the 1-minute load average is printed with
each round and stored with each record (``load1``); where it stays above ~1.5, say so beside the table.

    python experiments/speed/threads_under_load.py [--rounds 3] [--tokens 100] [--only ours]
Results: experiments/speed/results/threads_under_load.jsonl (one record per row and round).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Tell me a story."
RESULTS = Path(__file__).parent / "results" / "threads_under_load.jsonl"
RATE = re.compile(r"\(([0-9.]+) tokens/s\)")
BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
LLAMA = """
import sys
from selfextend.bench.llamacpp import LlamaCppGenerator
from selfextend.models.sources import resolve_model

gguf = resolve_model("smollm2-135m").gguf_path
gen = LlamaCppGenerator(gguf, n_ctx=2048, n_keep=1, threads=int(sys.argv[1]))
print(gen.tokens_per_second(gen.llm.tokenize(sys.argv[3].encode()), int(sys.argv[2])))
"""
# label -> (engine, threads or None for the default, environment added)
ROWS: dict[str, tuple[str, int | None, dict[str, str]]] = {
    "ours default": ("ours", None, {}),
    "ours -t 1": ("ours", 1, {}),
    "ours -t 2": ("ours", 2, {}),
    "ours before": ("ours", None, {"GOMP_SPINCOUNT": "300000"}),
    "ours passive": ("ours", None, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "llama.cpp -t 1": ("llama.cpp", 1, {}),
    "llama.cpp -t 2": ("llama.cpp", 2, {}),
    "llama.cpp -t 2 passive": ("llama.cpp", 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
}


def selfextend_command() -> list[str]:
    """The ``selfextend`` command beside this Python (the venv's), else ``python -m selfextend``."""
    beside = Path(sys.executable).with_name("selfextend")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("selfextend")
    return [found] if found else [sys.executable, "-m", "selfextend"]


def start_load(seconds: float) -> list[subprocess.Popen]:
    """One busy-loop process per CPU this process may use, each ending by itself after ``seconds``."""
    code = BUSY.format(seconds=seconds)
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in os.sched_getaffinity(0)]


def stop_load(load: list[subprocess.Popen]) -> None:
    """End the busy loops this script started (each by its own process)."""
    for process in load:
        process.terminate()
    for process in load:
        process.wait()


def rate(label: str, tokens: int) -> float:
    """Tokens per second of one fresh run of row ``label``."""
    engine, threads, extra = ROWS[label]
    env = {**os.environ, **extra}
    if engine == "ours":
        command = [*selfextend_command(), "generate", "-p", PROMPT, "-n", str(tokens), "--ignore-eos"]
        command += ["--temperature", "0", "--seed", "0"] + (["-t", str(threads)] if threads else [])
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        found = RATE.findall(done.stderr)
        if not found:
            raise RuntimeError(f"{label}: no rate in {done.stderr[-400:]!r}")
        return float(found[-1])
    command = [sys.executable, "-c", LLAMA, str(threads), str(tokens), PROMPT]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def table(records: list[dict], labels: list[str]) -> str:
    """Median tok/s per row, idle and loaded, with the range and the loaded/idle ratio."""
    lines = [f"{'row':<22} {'idle tok/s':>22} {'loaded tok/s':>22} {'loaded/idle':>11}"]
    for label in labels:
        cells, medians = [], []
        for loaded in (False, True):
            rates = [r["tokens_per_s"] for r in records if r["label"] == label and r["loaded"] == loaded]
            if not rates:
                cells.append(f"{'-':>22}")
                medians.append(None)
                continue
            medians.append(statistics.median(rates))
            cells.append(f"{medians[-1]:7.1f} ({min(rates):.1f}-{max(rates):.1f})".rjust(22))
        ratio = f"{medians[1] / medians[0]:.2f}" if None not in medians else "-"
        lines.append(f"{label:<22} {cells[0]} {cells[1]} {ratio:>11}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--only", choices=["ours", "llama.cpp"], help="only this engine's rows")
    parser.add_argument("--conditions", default="idle,loaded", help="idle, loaded or both (comma-separated)")
    parser.add_argument("--load-seconds", type=float, default=300.0, help="the most one load may last")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    labels = [label for label, row in ROWS.items() if args.only in (None, row[0])]
    conditions = [c.strip() == "loaded" for c in args.conditions.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    records: list[dict] = []
    for round_ in range(args.rounds):
        for loaded in conditions:
            for label in labels:
                load1 = os.getloadavg()[0]
                load = start_load(args.load_seconds) if loaded else []
                try:
                    time.sleep(1.0 if loaded else 0.0)  # the loops running before the row starts
                    tokens_per_s = rate(label, args.tokens)
                finally:
                    stop_load(load)
                record = {
                    "run": stamp,
                    "round": round_,
                    "label": label,
                    "loaded": loaded,
                    "load_processes": len(load),
                    "cpus": len(os.sched_getaffinity(0)),
                    "load1": round(load1, 2),
                    "tokens": args.tokens,
                    "tokens_per_s": round(tokens_per_s, 2),
                }
                records.append(record)
                with args.out.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                state = "loaded" if loaded else "idle"
                print(f"round {round_} {state:<6} load1 {load1:4.1f}  {label:<22} {tokens_per_s:7.1f} tok/s")
    print()
    print(table(records, labels))


if __name__ == "__main__":
    main()
