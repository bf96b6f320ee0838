"""The README's Python example, run exactly as written (extracted from README.md, so the two cannot drift)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

# Runs the example file given as argv[1] in this (child) process, then reports the child's own peak RSS
# and how long the example's text was in tokens. The peak is VmHWM, the high-water mark of this process's
# own address space: getrusage's ru_maxrss would carry over the parent's (pytest's) peak across fork+exec.
RUNNER = """
import json, runpy, sys
from selfextend.bench.runner import status_kib
ns = runpy.run_path(sys.argv[1], run_name="__main__")
n_tokens = len(ns["tokenizer"](ns["long_text"]).input_ids)
peak_kib = status_kib("VmHWM")
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


def without_inference_mode(code: str) -> str:
    """The snippet as a user who drops its ``torch.inference_mode()`` block would run it."""
    m = re.search(r"^with torch\.inference_mode\(\):.*\n((?:    .*\n)+)", code, re.M)
    return code[: m.start()] + textwrap.dedent(m.group(1)) + code[m.end() :]


@pytest.mark.real
@pytest.mark.parametrize("variant", ["as written", "without inference_mode"])
def test_readme_example_runs_under_2gb(tmp_path, variant):
    """The snippet as written (and without its inference_mode block: load_model turned gradients off), on
    its ~4k-token text, in a fresh interpreter: it runs, prints the reach, and the child's peak resident
    memory stays under 2 GB."""
    code = python_example()
    if variant != "as written":
        code = without_inference_mode(code)
        assert "inference_mode" not in code and "out = model(" in code
    example = tmp_path / "example.py"
    example.write_text(code, encoding="utf-8")
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


API = README.parent / "docs" / "reference" / "api.md"


@pytest.mark.real
def test_api_reference_examples_run_as_written(tmp_path):
    """The API reference's Python blocks, one after the other in a fresh interpreter on the default model:
    the reach printed, and the generation example's 200 tokens through context shifts in its 128 cells."""
    blocks = re.findall(r"```python\n(.*?)```", API.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 2
    example = tmp_path / "api.py"  # one interpreter for both (each loads the model: 15 s saved)
    example.write_text("\n".join(blocks), encoding="utf-8")
    r = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "29696"
    stats = re.fullmatch(r"200 tokens, (\d+) context shifts, cache (\d+) of 128", lines[-1])
    assert stats and int(stats[1]) >= 1 and int(stats[2]) <= 128, lines[-1]


def test_package_lists_and_exports_its_public_names():
    """``dir(selfextend)`` showed ``Any`` and ``importlib`` but none of the functions (tab completion
    missed them); the documented error types come from the package too."""
    import selfextend
    from selfextend.core.validate import ValidationError
    from selfextend.hf.facts import ModelError

    assert set(selfextend.__all__) <= set(dir(selfextend))
    assert selfextend.ValidationError is ValidationError and selfextend.ModelError is ModelError
    assert issubclass(selfextend.TokenIdError, ValueError)
