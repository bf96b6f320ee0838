"""The CLI's OpenMP wait policy (issue 42 item 14): idle workers spin briefly, then sleep, unless the user
chose otherwise, set before torch loads libgomp, as libgomp itself reports it (``OMP_DISPLAY_ENV``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from selfextend.cli.options import OPENMP_WAITS, quiet_openmp_waits

# -t imports torch (and its libgomp) while the line is parsed; the missing file then ends the command
ARGS = ["generate", "-t", "1", "-m", "/nonexistent/model.gguf"]


def libgomp_settings(**env: str) -> dict[str, str]:
    """What libgomp read at its load in a ``selfextend`` process run with ``env`` added."""
    clean = {k: v for k, v in os.environ.items() if k not in OPENMP_WAITS}
    code = "import sys; from selfextend.cli.main import main; sys.argv[0] = 'selfextend'; main()"
    r = subprocess.run(
        [sys.executable, "-c", code, *ARGS],
        env={**clean, "OMP_DISPLAY_ENV": "VERBOSE", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "no such file" in r.stderr, r.stderr
    return dict(re.findall(r"^\s+(\w+) = '([^']*)'", r.stderr, re.MULTILINE))


def test_cli_bounds_the_idle_workers_spin():
    settings = libgomp_settings()
    assert settings["GOMP_SPINCOUNT"] == "10000"  # libgomp's own default spins 300000 rounds


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"GOMP_SPINCOUNT": "300000"}, {"GOMP_SPINCOUNT": "300000"}),
        ({"OMP_WAIT_POLICY": "active"}, {"OMP_WAIT_POLICY": "ACTIVE"}),
    ],
)
def test_users_own_setting_kept(env, expected):
    settings = libgomp_settings(**env)
    assert {k: settings[k] for k in expected} == expected


def test_not_set_once_torch_is_loaded():
    import torch  # noqa: F401  (the test process has it; libgomp has read its environment)

    environ: dict[str, str] = {}
    assert not quiet_openmp_waits(environ) and environ == {}
