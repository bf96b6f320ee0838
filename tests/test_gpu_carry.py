"""What experiments/gpu/prepare.sh carries to the GPU machine (experiments/gpu/carried.txt), with the
machine's own packages (experiments/gpu/machine_packages.txt), holds everything each carried package requires
there: its requirements with the markers as on the machine (Python 3.12 on x86-64 Linux), at the machine's
versions where they are known. A GPU session has minutes: a package missing there fails every check at
import, as huggingface_hub 2's httpx2 and fastapi's opentelemetry-api did (found by
experiments/gpu/machine_venv.sh). The carried versions are this venv's: prepare.sh downloads those."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

GPU = Path(__file__).resolve().parents[1] / "experiments" / "gpu"
MACHINE_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def _names(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and line[0] != "#"]


def machine_packages() -> dict[str, str | None]:
    """The machine's packages by canonical name: their version where known, else None."""
    out = {}
    for entry in _names(GPU / "machine_packages.txt"):
        name, _, version = entry.partition("==")
        out[canonicalize_name(name)] = version or None
    return out


def unmet(carried: list[str], machine: dict[str, str | None]) -> list[str]:
    """Each requirement of a carried package (as installed here) that neither another carried package nor
    the machine's own meets, said as 'package needs requirement (what the machine has)'."""
    have = {canonicalize_name(n) for n in carried}
    wrong = []
    for package in carried:
        for line in metadata.requires(package) or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(MACHINE_MARKERS):
                continue
            name = canonicalize_name(req.name)
            if name in have:
                continue
            if name not in machine:
                wrong.append(f"{package} needs {req} (the machine has none)")
            elif machine[name] is not None and not req.specifier.contains(machine[name], prereleases=True):
                wrong.append(f"{package} needs {req} (the machine has {machine[name]})")
    return wrong


def test_the_carried_packages_need_nothing_the_machine_lacks() -> None:
    carried = _names(GPU / "carried.txt")
    assert "transformers" in carried and "fastapi" in carried
    assert unmet(carried, machine_packages()) == []


def test_the_check_fails_where_a_requirement_is_missing() -> None:
    """Without opentelemetry-api carried, fastapi's need of it is said; with the machine's huggingface_hub
    older than transformers asks, its version is said."""
    carried = [n for n in _names(GPU / "carried.txt") if n != "opentelemetry-api"]
    assert any(s.startswith("fastapi needs opentelemetry-api") for s in unmet(carried, machine_packages()))
    old_hub = {**machine_packages(), "huggingface-hub": "0.20.0"}
    assert any("(the machine has 0.20.0)" in s for s in unmet(["transformers"], old_hub))
