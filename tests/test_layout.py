"""The package's shape: imports flow one way, modules stay small, library code stays free of the CLI's
and the plots' dependencies at import time."""

from __future__ import annotations

import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import selfextend

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(selfextend.__file__).parent
MAX_LINES = 400


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], prefix="selfextend."))


def test_import_contracts_kept() -> None:
    """import-linter's contracts in pyproject.toml (layers; click only in the CLI) hold."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (it comes with the dev extra)")
    proc = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines; split it by job"


def test_library_imports_neither_click_nor_matplotlib() -> None:
    """Importing every library module (all but the CLI) loads neither click nor matplotlib."""
    library = [m for m in _modules() if not m.startswith("selfextend.cli") and m != "selfextend.__main__"]
    code = (
        "import importlib, sys\n"
        f"for m in {library!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in ('click', 'matplotlib') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
