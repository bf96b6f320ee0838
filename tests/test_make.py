"""The README's make targets change nothing outside the clone: no system package manager in any recipe."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = re.compile(r"\b(apt-get|apt|dpkg|sudo|yum|dnf|brew|snap)\b")


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
@pytest.mark.parametrize("target", ["install", "demo", "test", "docs", "lint"])
def test_make_targets_install_no_system_package(target, tmp_path):
    """Every command a target would run (``make -n -B``: printed, not run, as if nothing were built yet)
    stays away from the system's package manager; the browser test's chromium is .ci/run's business."""
    out = subprocess.run(
        ["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "pip install" in out or target != "install", out
    assert not SYSTEM.search(out), out
