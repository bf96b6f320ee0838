"""The documentation site builds with ``mkdocs build --strict`` (no broken link, missing page or API
reference), and the README stays short and links only to pages that exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_site_builds_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (it comes with the dev extra)")
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    # the command reference and the API were generated, not left as directives
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "--ctx" in cli and "--group-size" in cli and "::: mkdocs-click" not in cli
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "apply_self_extend" in api and "ContextShiftCache" in api
    # click 8.3's missing default is not printed as one; every command shows -h, as the CLI takes it
    assert "Sentinel.UNSET" not in cli
    assert cli.count("<code>-h</code>") >= 10
    # the docstrings' Sphinx roles became links or code, not raw text
    assert re.search(r":(class|func|meth|attr|exc|mod|data|obj):", api) is None
    assert 'href="#selfextend.core.validate.ValidationError"' in api


def test_readme_is_short_and_its_links_exist():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert any(t.startswith("docs/") for t in local)
    assert [t for t in local if not (ROOT / t).exists()] == []
