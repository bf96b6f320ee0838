"""The package's shape: the design's layout (the click commands in the top-level ``cli/`` folder, installed
as ``selfextend.cli``), imports flow one way, modules stay small, library code stays free of the CLI's and
the plots' dependencies at import time."""

from __future__ import annotations

import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the dev extra's tomli
    import tomli as tomllib

import selfextend

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(selfextend.__file__).parent
CLI = ROOT / "cli"
MAX_LINES = 400


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], prefix="selfextend."))


def test_cli_folder_installs_as_selfextend_cli() -> None:
    """``selfextend.cli`` is the top-level cli/ folder, and pyproject.toml names every package there is:
    selfextend's subfolders, its data folders (the chat page: no ``__init__.py``, files named in package-data)
    and the folders its package-dir maps in (none left out of a wheel)."""
    import selfextend.cli

    assert Path(selfextend.cli.__file__).resolve().parent == CLI
    assert not (PACKAGE / "cli").exists()
    tools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    on_disk = {"selfextend"} | {
        "selfextend." + ".".join(p.parent.relative_to(PACKAGE).parts) for p in PACKAGE.rglob("*/__init__.py")
    }
    mapped = tools["package-dir"]
    assert mapped == {"selfextend.cli": "cli"}
    on_disk |= {
        "selfextend.cli." + ".".join(p.parent.relative_to(CLI).parts) for p in CLI.rglob("*/__init__.py")
    }
    data = {
        "selfextend." + ".".join(d.relative_to(PACKAGE).parts)
        for d in PACKAGE.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and not (d / "__init__.py").exists()
    }
    assert data <= set(tools["package-data"])
    assert sorted(tools["packages"]) == sorted(on_disk | data | set(mapped))


def test_import_contracts_kept() -> None:
    """import-linter's contracts in pyproject.toml (layers; click only in the CLI) hold, over the package as
    it installs (cli/ as selfextend.cli: .ci/lint_imports.py)."""
    if shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("import-linter is not installed (it comes with the dev extra)")
    script = ROOT / ".ci" / "lint_imports.py"
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    # a layer import-linter cannot find is an error, so a kept layers contract has read selfextend.cli
    assert "Contracts: 2 kept, 0 broken." in proc.stdout


@pytest.mark.parametrize(
    "path",
    sorted([*PACKAGE.rglob("*.py"), *CLI.rglob("*.py")]),
    ids=lambda p: str(p.relative_to(ROOT)),
)
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


def _imports_of(path: Path) -> set[str]:
    """The selfextend modules a file imports anywhere in it (function-level imports included)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] == "selfextend"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while part[-1:] != [v]:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    """No two modules import each other, even through function-level imports (issue 43: blocks and the
    kernels' bindings once did)."""
    package = Path(selfextend.__file__).parent
    graph = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _imports_of(path)
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the check itself can fail
    assert _cycles(graph) == []
