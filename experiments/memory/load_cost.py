"""What loading a GGUF costs: disk cache size, peak RSS while loading, load time, first tokens.

Each model and weight form is loaded twice, each time in a fresh process: "cold" into an empty
cache folder (conversion included) and "warm" from what the cold load left there. Peak RSS is
the process's resident high-water mark (VmHWM) after the load, so it includes the ~0.3-0.5 GB
that importing torch and transformers takes (reported apart as ``rss_imports_mb``); ``peak_anon_mb``
leaves out the file-backed pages resident after the load (shared libraries), whose count follows the
page cache more than the load: a fresh install's hot files added ~80 MB to a cold load's peak. The
run-form size is the bytes of every parameter and buffer of the loaded model (shared storage
counted once). Load time is given as wall time and as the process's CPU time (user + system,
all threads), which other work on a shared machine disturbs less. Each run also greedy-decodes a
few tokens of a fixed prompt, so a later run of the same command shows whether the loaded weights
still give the same tokens.

    python experiments/memory/load_cost.py --label after [--models smollm2-135m gemma3-270m]
        [--forms int8 int4 float32 bfloat16] [--out experiments/memory/results/load_cost.jsonl]
    python experiments/memory/load_cost.py --table     # the README's before/after table

A model may also be a .gguf path (``--name`` then labels it). Loads go through
``selfextend.cli.options.load_with_self_extend``, the path every command takes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROMPT = "The history of the United States begins with"
NEW_TOKENS = 16


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])  # kB
    raise KeyError(field)


def worker(model: str, form: str) -> None:
    """One load in this process; prints a JSON line."""
    import torch

    from selfextend.cli.options import load_with_self_extend

    rss_imports, anon_imports = _vm("VmRSS"), _vm("RssAnon")
    weights, dtype = (form, "float32") if form in ("int8", "int4") else ("float", form)
    start, cpu_start = time.perf_counter(), time.process_time()
    lm, tokenizer = load_with_self_extend(model, dtype, "cpu", None, None, weights)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak, file_backed = _vm("VmHWM"), _vm("RssFile")  # RssFile: mapped library and file pages resident
    seen: set[int] = set()
    run_bytes = 0
    for t in [*lm.parameters(), *lm.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            run_bytes += t.untyped_storage().nbytes()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = lm.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    tokens = out[0, ids.shape[1] :].tolist()
    record = {
        "load_s": round(seconds, 2),
        "load_cpu_s": round(cpu_seconds, 2),
        "peak_rss_mb": round(peak / 1024, 1),
        # the peak less the file-backed pages (torch's libraries, mostly): how many of those are resident
        # depends on the page cache (a fresh install's files are hot), not on the load
        "peak_anon_mb": round((peak - file_backed) / 1024, 1),
        "rss_imports_mb": round(rss_imports / 1024, 1),
        # of them the process's own (a CUDA build of torch takes ~125 MB more than the CPU build)
        "anon_imports_mb": round(anon_imports / 1024, 1),
        "run_form_mb": round(run_bytes / 2**20, 1),
        "tokens": tokens,
        "text": tokenizer.decode(tokens),
    }
    print("RESULT " + json.dumps(record), flush=True)


def _du(path: Path) -> int:
    """Bytes of the files under ``path``, a file with several names (a hard link) counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def run_one(model: str, form: str, cache: Path) -> dict:
    env = {**os.environ, "SELFEXTEND_CACHE": str(cache), "TQDM_DISABLE": "1"}
    cmd = [sys.executable, __file__, "--worker", model, form]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker failed for {model} {form}:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def table(path: Path) -> str:
    """Markdown table of the before/after records in ``path`` (the latest record per label, model, form)."""
    latest: dict[tuple[str, str, str], dict] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        latest[r["label"], r["model"], r["form"]] = r
    rows = [
        "| model | weights | label | run form MiB | disk cache MiB | cold load s (CPU s) | cold peak RSS MiB "
        "| warm load s (CPU s) | warm peak RSS MiB | RSS target MiB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (label, model, form), r in sorted(
        latest.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0] != "before")
    ):
        c, w = r["cold"], r["warm"]
        target = 1.5 * w["run_form_mb"] + 400
        rows.append(
            f"| {model} | {form} | {label} | {w['run_form_mb']:.0f} | {r['cache_mb']:.0f} | "
            f"{c['load_s']:.0f} ({c['load_cpu_s']:.0f}) | {c['peak_rss_mb']:.0f} | "
            f"{w['load_s']:.0f} ({w['load_cpu_s']:.0f}) | {w['peak_rss_mb']:.0f} | {target:.0f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "FORM"), help=argparse.SUPPRESS)
    parser.add_argument("--label", default="after", help="before/after, stored in each record")
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--names", nargs="*", default=None, help="labels for --models (for .gguf paths)")
    parser.add_argument("--forms", nargs="+", default=["int8", "float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=RESULTS / "load_cost.jsonl")
    parser.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    args = parser.parse_args()
    if args.table:
        print(table(args.out))
        return
    if args.worker:
        worker(*args.worker)
        return
    names = args.names or args.models
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for model, name in zip(args.models, names, strict=True):
        for form in args.forms:
            cache = Path(tempfile.mkdtemp(prefix="selfextend-loadcost-"))
            try:
                cold = run_one(model, form, cache)
                disk = _du(cache)
                # a GGUF assembled into the cache (gemma3-270m) is the source, not the conversion
                source = sum(p.stat().st_size for p in cache.rglob("*.gguf"))
                warm = run_one(model, form, cache)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            record = {
                "label": args.label,
                "model": name,
                "form": form,
                "cache_mb": round((disk - source) / 2**20, 1),
                "cold": cold,
                "warm": warm,
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            c, w = cold, warm
            print(
                f"{args.label} {name} {form}: cache {record['cache_mb']} MB, run form {w['run_form_mb']} MB, "
                f"cold {c['load_s']} s ({c['load_cpu_s']} s CPU) / {c['peak_rss_mb']} MB peak, "
                f"warm {w['load_s']} s ({w['load_cpu_s']} s CPU) / "
                f"{w['peak_rss_mb']} MB peak, tokens same cold/warm: {c['tokens'] == w['tokens']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
