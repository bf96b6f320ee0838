"""check.py's cli section: each command on ``--device cuda`` against ``--device cpu`` on the tiny model of
``.gpu/tiny`` (float32, f32 cells), outputs compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from server_util import free_port, request, wait_healthy

# float32 weights on both devices: a GPU's default dtype is bfloat16, and --weights auto is int8 on the CPU
# (a first GPU run compared int8 CPU runs with float GPU ones, and chat and serve parted a few tokens in)
FLOAT = ["--dtype", "float32", "--weights", "float"]
COMMON = ["--temperature", "0", "--cache-type", "f32", *FLOAT]
DEVICES = ["cpu", "cuda"]  # against the CPU: the device under test (check.py --dry-run: the CPU again)


def _env(root: Path) -> dict[str, str]:
    """This process's environment with the checkout on the path after what is there (run.sh's .gpu/site:
    the carried packages a GPU machine lacks)."""
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(root)]))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "SELFEXTEND_COMPILE": "0"}


def _cli(root: Path, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(root / "experiments/gpu/cli.py"), *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=_env(root), timeout=300)


def _said(report: Callable[..., None], name: str, runs: tuple, same: bool) -> None:
    """One record of a command run on both devices; where the outputs part, where and how (and both
    outputs whole in ``$OUT/cli_outputs.json``)."""
    codes = [r.returncode for r in runs]
    tail = runs[1].stderr.strip().splitlines()[-1:] if runs[1].stderr.strip() else []
    parted = {}
    a, b = runs[0].stdout, runs[1].stdout
    if a != b:
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        around = slice(max(0, at - 40), at + 40)
        parted = {"parts_at_char": at, "cpu": a[around], "cuda": b[around]}
        errs = {"cpu_err": runs[0].stderr[-2000:], "cuda_err": runs[1].stderr[-2000:]}
        _dump(name, {"cpu": a, "cuda": b, **errs})
    report(name, ok=same and codes == [0, 0], exit_codes=codes, cuda_said=tail, **parted)


def _dump(name: str, record: dict) -> None:
    """``record`` under ``name`` in ``$OUT/cli_outputs.json`` (else ./cli_outputs.json)."""
    path = Path(os.environ.get("OUT") or ".") / "cli_outputs.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**known, name: record}, indent=1))


def _records(path: Path, field: str) -> list:
    return [r.get(field) for r in map(json.loads, path.read_text().splitlines())] if path.exists() else []


def cli_checks(report: Callable[..., None], root: Path, device: str = "cuda") -> None:
    """Every command on both devices at once (a process each, ten in all, then the two servers): the
    processes' start-up (imports, the GPU's context) is most of each one's time."""
    DEVICES[1] = device
    model = str(root / ".gpu/tiny")
    if not Path(model).exists():
        report("cli", ok=False, error="no .gpu/tiny: run experiments/gpu/prepare.sh where selfextend runs")
        return
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text((root / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
        keyed = ["passkey", "-m", model, *FLOAT, "--lengths", "200", "--depths", "0.5", "--trials", "2"]
        keyed += ["--method", "selfextend:G=2,W=32", "--method", "shift:ctx=96,keep=4"]
        scored = ["ppl", "-m", model, *FLOAT, "--corpus", str(corpus), "--lengths", "128,400"]
        scored += ["--method", "plain", "--method", "selfextend:G=2,W=32"]
        generate = ["generate", "-m", model, "-p", "The sea is", "-n", "90", "--ctx", "64", "--ignore-eos"]
        gguf = ["generate", "-m", str(root / "tests/data/llama_server/tiny-chat.gguf"), "-p", "The sea is"]
        gguf += ["-n", "40", "--ctx", "32", "--ignore-eos", "--weights", "float"]
        commands = {  # name: (arguments, stdin, whether it writes records with -o)
            "cli generate": ([*generate, *COMMON], None, False),
            "cli generate -g 2 -w 32": ([*generate, "-g", "2", "-w", "32", *COMMON], None, False),
            "cli chat": (
                ["chat", "-m", model, "-n", "30", "--ctx", "96", "-q", *COMMON],
                "Hello there\n/stats\nTell me about the sea\n",
                False,
            ),
            "cli generate gguf": ([*gguf, *COMMON], None, False),  # dequantized at load, on both devices
            "cli passkey": (keyed, None, True),
            "cli ppl": (scored, None, True),
        }
        benched = Path(tmp) / "bench.jsonl"  # every case but llama.cpp's, small, on the device under test
        bench = ["bench", "-m", model, "--device", device, "--lengths", "256", "--decode-lengths", "256"]
        bench += ["--reference-max", "256", "--ctx", "128", "--endless-tokens", "64", "-g", "2", "-w", "32"]
        bench += ["--repeats", "1", "--cases", "prefill,decode,endless,generate", "-o", str(benched)]
        jobs = {}
        with ThreadPoolExecutor(len(commands) * len(DEVICES) + 1) as pool:
            for name, (args, stdin, written) in commands.items():
                for i, d in enumerate(DEVICES):  # (a dry run's two devices are both the CPU: files by index)
                    extra = ["-o", str(Path(tmp) / f"{name.split()[1]}-{i}.jsonl")] if written else []
                    jobs[name, i] = pool.submit(_cli, root, [*args, "--device", d, *extra], stdin)
            jobs["cli bench", 1] = pool.submit(_cli, root, bench)
        runs = {key: job.result() for key, job in jobs.items()}
        _bench(report, runs["cli bench", 1], benched, device)
        for name in ("cli generate", "cli generate -g 2 -w 32", "cli generate gguf", "cli chat"):
            pair = (runs[name, 0], runs[name, 1])
            _said(report, name, pair, pair[0].stdout == pair[1].stdout)
        answers = [_records(Path(tmp) / f"passkey-{i}.jsonl", "answer") for i in range(2)]
        _said(
            report, "cli passkey", (runs["cli passkey", 0], runs["cli passkey", 1]), answers[0] == answers[1]
        )
        ppl = [_records(Path(tmp) / f"ppl-{i}.jsonl", "ppl") for i in range(2)]
        worst = max(abs(a / b - 1) for a, b in zip(*ppl, strict=True)) if all(ppl) else float("inf")
        pair = (runs["cli ppl", 0], runs["cli ppl", 1])
        _said(report, f"cli ppl (worst relative difference {worst:.1e})", pair, worst < 1e-4)
    serve_check(report, root, model)


def _bench(report: Callable[..., None], run: subprocess.CompletedProcess, records: Path, device: str) -> None:
    """``bench`` on the device: it ran every case asked, and each row names the device's GPU (the CPU's
    model in a dry run)."""
    rows = list(map(json.loads, records.read_text().splitlines())) if records.exists() else []
    cases = sorted({r.get("case") for r in rows if "case" in r})
    named = {r.get("device") for r in rows if "case" in r}
    want = torch.cuda.get_device_name(device) if device.startswith("cuda") else None
    ok = (
        run.returncode == 0 and {"prefill", "decode", "endless", "generate"} <= set(cases) and len(named) == 1
    )
    ok = ok and (want is None or named == {want})
    tail = run.stderr.strip().splitlines()[-1:] if run.returncode else []
    report(
        "cli bench", ok=ok, exit_code=run.returncode, cases=cases, device=sorted(map(str, named)), said=tail
    )


def _replies(base: str, prompts: list[str], together: bool) -> list[str]:
    """Greedy completions of ``prompts``, sent at once (``together``) or one after another."""
    out = [""] * len(prompts)

    def ask(i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": 80, "temperature": 0}
        status, reply = request(base, "POST", "/v1/completions", body, timeout=120)
        out[i] = reply["choices"][0]["text"] if status == 200 else f"status {status}"

    if not together:
        for i in range(len(prompts)):
            ask(i)
        return out
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def serve_check(report: Callable[..., None], root: Path, model: str) -> None:
    """``serve --parallel 2`` on each device (both servers up at once): two requests at once, then each
    alone; all replies equal."""
    prompts = ["The sea is", "Once upon a time, in a land far away,"]
    servers = []
    for device in DEVICES:
        port = free_port()
        cmd = [sys.executable, str(root / "experiments/gpu/cli.py"), "serve", "-m", model, "--device", device]
        cmd += ["--parallel", "2", "--ctx", "64", "--port", str(port), "--cache-type", "f32", *FLOAT]
        proc = subprocess.Popen(cmd, env=_env(root), stderr=subprocess.PIPE, text=True)
        servers.append((device, f"http://127.0.0.1:{port}", proc))
    replies = []
    try:
        for device, base, proc in servers:
            try:
                wait_healthy(base, 180, proc)
                replies.append((_replies(base, prompts, True), _replies(base, prompts, False)))
            except (RuntimeError, TimeoutError, OSError) as e:
                lines = str(e).strip().splitlines() or [""]  # a traceback's last line says what failed
                report(f"cli serve {device}", ok=False, error=lines[0][:200], last=lines[-1][:300])
                return
    finally:
        for _, _, proc in servers:
            proc.terminate()
            proc.wait(30)
    together, alone = replies[1]
    ok = together == alone == replies[0][0]
    if not ok:
        _dump("cli serve 2 slots", {"cpu together": replies[0][0], "cpu alone": replies[0][1],
                                    "cuda together": together, "cuda alone": alone})  # fmt: skip
    report(
        "cli serve 2 slots",
        ok=ok,
        replies=[r[:40] for r in together],
        cuda_alone_same=together == alone,
        cpu_same=replies[0][0] == replies[0][1],
    )
