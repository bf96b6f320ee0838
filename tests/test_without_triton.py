"""Without triton (a CPU-only torch brings none): every module imports, and the commands that reach the
fused kernels' gates run, in a process that cannot see triton. The whole suite passes that way too
(``PYTHONPATH`` to a folder holding :data:`HIDE` as ``sitecustomize.py``), but runs twice as long; this
keeps the likeliest regression, a module importing triton unguarded, out of every run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HIDE = """
import importlib.machinery
import sys


class _NoTriton(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return None
        return super().find_spec(name, path, target)


sys.meta_path = [_NoTriton if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""

CHECK = """
import importlib, importlib.util, pkgutil, sys
import selfextend
assert importlib.util.find_spec("triton") is None
names = [m.name for m in pkgutil.walk_packages(selfextend.__path__, "selfextend.")]
for name in names:
    importlib.import_module(name)
assert "triton" not in sys.modules, "a module imported triton"
from selfextend.cli.main import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code or 0
print("exit", code, len(names))
"""


def _hidden(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``selfextend ARGS`` after importing every module, in a process where triton cannot be found."""
    (tmp_path / "sitecustomize.py").write_text(HIDE)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PATH"] = "/usr/bin:/bin"
    return subprocess.run(
        [sys.executable, "-c", CHECK, *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_every_module_imports_and_info_and_generate_run_without_triton(tmp_path, tiny_dir) -> None:
    info = _hidden(tmp_path, "info", str(tiny_dir), "-g", "4", "-w", "64")
    assert info.returncode == 0 and info.stdout.splitlines()[-1].startswith("exit 0 "), info.stderr[-2000:]
    assert any(line.startswith("GPU ") for line in info.stdout.splitlines()), info.stdout
    generate = ["generate", "-m", str(tiny_dir), "-p", "The sea", "-n", "6", "-g", "2", "-w", "8"]
    out = _hidden(tmp_path, *generate, "--temperature", "0", "--ignore-eos")
    assert out.returncode == 0 and out.stdout.splitlines()[-1].startswith("exit 0 "), out.stderr[-2000:]
    assert "6 tokens" in out.stderr, out.stderr
