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


# PyPI's torch for Linux x86-64 (a CUDA build) pins its own triton: torch 2.13.0 asks triton==3.7.1 (its
# metadata on PyPI, read 2026-11-29 with `pip install --dry-run --report`). Everywhere but this workplace,
# whose torch is a local CPU build without triton, `make install` takes that torch.
PYPI_TORCH_TRITON = {"2.13.0": "3.7.1"}


def test_the_dev_extra_resolves_beside_pypis_torch() -> None:
    """The torch the Makefile installs is one the package takes, and the dev extra's triton admits the one
    that torch pins on PyPI: an exact triton 3.9.0 made `make install` (both README commands)
    ResolutionImpossible on any Linux x86-64 machine outside this workplace. A torch bumped in the Makefile
    needs its triton recorded above."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    from packaging.requirements import Requirement

    torch_version = re.search(r"torch==([\w.+]+)", (ROOT / "Makefile").read_text()).group(1)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch")
    triton = next(Requirement(r) for r in project["optional-dependencies"]["dev"] if r.startswith("triton"))
    assert torch_req.specifier.contains(torch_version)
    assert triton.specifier.contains(PYPI_TORCH_TRITON[torch_version]), triton
    assert triton.specifier.contains("3.9.0")  # the interpreter's tests ask it: the CPU torch's newest
