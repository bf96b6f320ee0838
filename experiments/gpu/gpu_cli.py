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
from pathlib import Path

from server_util import free_port, request, wait_healthy

COMMON = ["--temperature", "0", "--cache-type", "f32"]
DEVICES = ["cpu", "cuda"]  # against the CPU: the device under test (check.py --dry-run: the CPU again)


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "SELFEXTEND_COMPILE": "0"}


def _cli(root: Path, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(root / "experiments/gpu/cli.py"), *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=_env(root), timeout=300)


def _both(root: Path, args: list[str], stdin: str | None = None) -> tuple[subprocess.CompletedProcess, ...]:
    return tuple(_cli(root, [*args, "--device", d], stdin) for d in DEVICES)


def _written(root: Path, args: list[str], outs: list[Path]) -> tuple[subprocess.CompletedProcess, ...]:
    """``args`` on each device, writing records to its own file of ``outs``."""
    return tuple(_cli(root, [*args, "--device", d, "-o", str(o)]) for d, o in zip(DEVICES, outs, strict=True))


def _said(report: Callable[..., None], name: str, runs: tuple, same: bool) -> None:
    codes = [r.returncode for r in runs]
    tail = runs[1].stderr.strip().splitlines()[-1:] if runs[1].stderr.strip() else []
    report(name, ok=same and codes == [0, 0], exit_codes=codes, cuda_said=tail)


def cli_checks(report: Callable[..., None], root: Path, device: str = "cuda") -> None:
    DEVICES[1] = device
    model = str(root / ".gpu/tiny")
    if not Path(model).exists():
        report("cli", ok=False, error="no .gpu/tiny: run experiments/gpu/prepare.sh where selfextend runs")
        return
    for extra in ([], ["-g", "2", "-w", "32"]):
        args = ["generate", "-m", model, "-p", "The sea is", "-n", "90", "--ctx", "64", "--ignore-eos"]
        runs = _both(root, args + extra + COMMON)
        _said(report, f"cli generate {' '.join(extra)}".strip(), runs, runs[0].stdout == runs[1].stdout)
    chat = "Hello there\n/stats\nTell me about the sea\n"
    runs = _both(root, ["chat", "-m", model, "-n", "30", "--ctx", "96", "-q", *COMMON], chat)
    _said(report, "cli chat", runs, runs[0].stdout == runs[1].stdout)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"passkey-{i}.jsonl" for i in range(2)]
        keyed = ["passkey", "-m", model, "--lengths", "200", "--depths", "0.5", "--trials", "2"]
        keyed += ["--method", "selfextend:G=2,W=32", "--method", "shift:ctx=96,keep=4"]
        runs = _written(root, keyed, outs)
        answers = [[r.get("answer") for r in map(json.loads, o.read_text().splitlines())] for o in outs]
        _said(report, "cli passkey", runs, answers[0] == answers[1])
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text((root / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
        outs = [Path(tmp) / f"ppl-{i}.jsonl" for i in range(2)]
        scored = ["ppl", "-m", model, "--corpus", str(corpus), "--lengths", "128,400"]
        scored += ["--method", "plain", "--method", "selfextend:G=2,W=32"]
        runs = _written(root, scored, outs)
        ppl = [[r["ppl"] for r in map(json.loads, o.read_text().splitlines())] for o in outs]
        worst = max(abs(a / b - 1) for a, b in zip(*ppl, strict=True)) if all(ppl) else float("inf")
        _said(report, f"cli ppl (worst relative difference {worst:.1e})", runs, worst < 1e-4)
    serve_check(report, root, model)


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
    """``serve --parallel 2`` on each device: two requests at once, then each alone; all replies equal."""
    prompts = ["The sea is", "Once upon a time, in a land far away,"]
    replies = {}
    for device in DEVICES:
        port = free_port()
        cmd = [sys.executable, str(root / "experiments/gpu/cli.py"), "serve", "-m", model, "--device", device]
        cmd += ["--parallel", "2", "--ctx", "64", "--port", str(port), "--cache-type", "f32"]
        proc = subprocess.Popen(cmd, env=_env(root), stderr=subprocess.PIPE, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, 180, proc)
            replies[device] = (_replies(base, prompts, True), _replies(base, prompts, False))
        except (RuntimeError, TimeoutError, OSError) as e:
            report(f"cli serve {device}", ok=False, error=str(e).splitlines()[0][:300])
            return
        finally:
            proc.terminate()
            proc.wait(30)
    together, alone = replies[DEVICES[1]]
    report("cli serve 2 slots", ok=together == alone == replies["cpu"][0], replies=[r[:40] for r in together])
