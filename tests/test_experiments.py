"""experiments/ stays traceable: every path the docs and the code name exists, every script is listed in
experiments/README.md, and the page each row names shows that script (issue 43)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
INDEX = EXPERIMENTS / "README.md"
# a path under experiments/, as prose and code write it; "<commit>:experiments/..." (git show) is history
PATH = re.compile(r"(?<![0-9a-f]:)\bexperiments/[\w./{},*$-]*")
ROW = re.compile(r"^\| `(?P<script>[\w/.-]+\.(?:py|sh))` \|.*\|(?P<pages>[^|]*)\|\s*$", re.MULTILINE)


def _texts() -> list[Path]:
    """Every file that may name an experiments/ path: the docs, the package, the tests, the scripts."""
    files = [
        ROOT / "README.md",
        ROOT / "ARCHITECTURE.md",
        ROOT / "Makefile",
        *sorted((ROOT / "docs").rglob("*.md")),
    ]
    for folder, patterns in (
        ("selfextend", ("*.py", "*.c", "*.h")),
        ("cli", ("*.py",)),
        ("tests", ("*.py",)),
    ):
        files += [p for pattern in patterns for p in sorted((ROOT / folder).rglob(pattern))]
    files += [p for p in sorted(EXPERIMENTS.rglob("*")) if p.suffix in (".py", ".sh", ".md")]
    return [p for p in files if p.is_file() and p != Path(__file__).resolve()]


def _expand(path: str) -> list[str]:
    """``a/{b,c}_d*`` -> glob patterns ``a/b_d*``, ``a/c_d*``; a shell variable ends the fixed part."""
    path = path.rstrip(".,")
    if "$" in path:
        path = path[: path.index("$")] + "*"
    parts = re.split(r"\{([^}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _scripts() -> list[str]:
    return sorted(
        str(p.relative_to(EXPERIMENTS))
        for p in EXPERIMENTS.rglob("*")
        if p.suffix in (".py", ".sh") and p.is_file()
    )


def test_every_experiments_path_named_exists():
    missing = []
    for file in _texts():
        for match in PATH.finditer(file.read_text(encoding="utf-8", errors="replace")):
            for pattern in _expand(match.group(0)):
                if file.suffix == ".sh" and not pattern.endswith("*"):
                    pattern += "*"  # a shell script builds names from a prefix: out=.../x; "${out}_y"
                if not any(ROOT.glob(pattern)) and not (ROOT / pattern).exists():
                    missing.append(f"{file.relative_to(ROOT)}: {pattern}")
    assert missing == []


def test_the_path_check_can_fail():
    assert not any(ROOT.glob(_expand("experiments/speed/no_such_script.py")[0]))
    assert _expand("experiments/x/results/a_{b,c}.jsonl.") == [
        "experiments/x/results/a_b.jsonl",
        "experiments/x/results/a_c.jsonl",
    ]
    assert PATH.search("git show 505ff03:experiments/gone.py") is None


def test_every_script_is_in_the_index():
    listed = {m["script"] for m in ROW.finditer(INDEX.read_text(encoding="utf-8"))}
    assert [s for s in _scripts() if s not in listed] == []
    assert [s for s in sorted(listed) if not (EXPERIMENTS / s).is_file()] == []


def test_each_index_row_names_a_page_that_shows_the_script():
    wrong = []
    for m in ROW.finditer(INDEX.read_text(encoding="utf-8")):
        pages = re.findall(r"\]\(([^)#]+)\)", m["pages"])
        if not pages:
            wrong.append(f"{m['script']}: no page")
        for page in pages:
            text = (EXPERIMENTS / page).resolve().read_text(encoding="utf-8")
            if f"experiments/{m['script']}" not in text:
                wrong.append(f"{m['script']}: not in {page}")
    assert wrong == []
