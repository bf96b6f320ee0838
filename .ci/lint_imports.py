"""import-linter over the package as it installs: ``selfextend/`` with each folder that pyproject.toml's
``package-dir`` maps into it (the top-level ``cli/`` as ``selfextend.cli``).

grimp reads a package's modules from the one folder its import spec names, so this mirrors the installed
layout with symbolic links in a temporary folder and runs ``lint-imports`` there with the project's
contracts. Arguments go to ``lint-imports``; its exit status is this script's."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the dev extra's tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def mirror(into: Path) -> None:
    """``into/selfextend``: links to the package's own entries and to the folders mapped into it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    mapped = config["tool"]["setuptools"].get("package-dir", {})
    package = into / "selfextend"
    package.mkdir()
    for entry in (ROOT / "selfextend").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in mapped.items():
        parent, _, child = name.rpartition(".")
        if parent != "selfextend":
            raise SystemExit(f"package-dir maps {name}: only direct subpackages of selfextend are mirrored")
        (package / child).symlink_to(ROOT / folder)


def main() -> int:
    lint = Path(sys.executable).with_name("lint-imports")
    with tempfile.TemporaryDirectory() as tmp:
        mirror(Path(tmp))
        command = [str(lint), str(ROOT / "pyproject.toml"), "--no-cache", *sys.argv[1:]]
        return subprocess.run(command, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
