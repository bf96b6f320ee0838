"""The wheel ``pip wheel .`` builds holds what an installed (not editable) copy needs: every module of
selfextend/ and of cli/ (as selfextend.cli), the native kernels' C source, the chat page and the console
script. Installing it into a fresh venv and running ``selfextend generate`` from another folder takes
minutes (torch), so CI runs that after the suite: .ci/wheel_check.sh."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("selfextend-*.whl")
    with zipfile.ZipFile(path) as z:
        yield z


def test_wheel_holds_every_module_and_data_file(wheel):
    names = set(wheel.namelist())
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "selfextend").rglob("*") if p.is_file()}
    cli = {"selfextend/cli/" + str(p.relative_to(ROOT / "cli")) for p in (ROOT / "cli").rglob("*.py")}
    wanted = {n for n in package | cli if "__pycache__" not in n}
    assert {"selfextend/native/decode.c", "selfextend/server/page/index.html"} <= wanted
    assert {"selfextend/cli/main.py", "selfextend/server/page/chat.js"} <= wanted
    assert wanted <= names, sorted(wanted - names)
    assert not any(n.startswith(("cli/", "tests/", "experiments/", "docs/")) for n in names)


def test_wheel_declares_the_console_script(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    assert "[console_scripts]" in text and "selfextend = selfextend.cli.main:main" in text
