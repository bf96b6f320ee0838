"""The README's Python example, run exactly as written (extracted from README.md, so the two cannot drift)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

# Runs the example file given as argv[1] in this (child) process, then reports the child's own peak RSS
# and how long the example's text was in tokens.
RUNNER = """
import json, resource, runpy, sys
ns = runpy.run_path(sys.argv[1], run_name="__main__")
n_tokens = len(ns["tokenizer"](ns["long_text"]).input_ids)
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
print(json.dumps({"peak_mib": peak_kib / 1024, "tokens": n_tokens}))
"""


def python_example() -> str:
    """The first ```python block of the README's "## Python" section."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_is_found():
    code = python_example()
    assert "load_model(" in code and "long_text =" in code and "inference_mode" in code


@pytest.mark.real
def test_readme_example_runs_under_2gb(tmp_path):
    """The snippet as written, on its ~4k-token text, in a fresh interpreter: it runs, prints the reach,
    and the child's peak resident memory stays under 2 GB."""
    example = tmp_path / "example.py"
    example.write_text(python_example(), encoding="utf-8")
    r = subprocess.run(
        [sys.executable, "-c", RUNNER, str(example)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "29696"
    report = json.loads(lines[-1])
    assert 3500 <= report["tokens"] <= 5000, report
    assert report["peak_mib"] < 2000, report
