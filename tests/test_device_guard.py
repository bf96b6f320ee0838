"""The engine's paths keep every tensor a step makes on the model's device: what a GPU needs, checked here
without one (tests/device_guard.py: host-made tensors mixed with the model's are what CUDA refuses).

The native kernels read CPU memory only, so on a GPU the steps run torch's ops alone; each test turns the
kernels off as a GPU run has them off, then runs the path whole, with real values, context shifts and
Self-Extend, under the guard.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tiny_gemma3
from device_guard import DeviceGuard

import selfextend.generation.decode as decode_module
from selfextend.evaluation.methods import applied, parse_method
from selfextend.evaluation.nll import token_nll
from selfextend.evaluation.passkey import answer
from selfextend.generation.batched import BatchedDecode
from selfextend.generation.generator import Generator, run
from selfextend.generation.sampling import SamplingParams
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache

PROMPT = list(range(3, 40))


@pytest.fixture(autouse=True)
def _no_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's backend as on a GPU: torch ops, no native kernel."""
    monkeypatch.setattr(decode_module, "native_kernels", lambda: None)


def _model(family: str, self_extend: bool) -> torch.nn.Module:
    model = (
        tiny_gemma3(["sliding_attention", "full_attention"], 8) if family == "gemma3" else make_model(family)
    )
    if self_extend:
        apply_self_extend(model, group_size=4, window=16)
    return model


def test_the_guard_sees_a_host_tensor_mixed_in() -> None:
    """The guard's own check: a position made without ``device=`` and added to a model tensor is flagged,
    one made with it is not (so the tests below can fail)."""
    model = make_model("llama")
    with DeviceGuard(model) as guard:
        inv_freq = model.model.rotary_emb.inv_freq
        _ = torch.arange(4, device=inv_freq.device)[:, None] * inv_freq
        _ = torch.tensor(2.0) * inv_freq  # a 0-dim host tensor: CUDA takes it as a scalar
    assert guard.mixed == []
    with DeviceGuard(model) as guard:
        _ = torch.arange(4)[:, None] * model.model.rotary_emb.inv_freq
    assert len(guard.mixed) == 1 and "arange(4)" in guard.mixed[0][1]
    with pytest.raises(AssertionError, match="mix host and device"):
        guard.check()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("self_extend", [False, True], ids=["plain", "self-extend"])
def test_generate_through_shifts_stays_on_the_device(family: str, self_extend: bool) -> None:
    """Prefill, the direct decode step, sampling with a seed and two context shifts."""
    model = _model(family, self_extend)
    with DeviceGuard(model) as guard:
        gen = Generator(
            model, ContextShiftCache(model, 48, n_keep=4), SamplingParams(temperature=0.8), seed=1
        )
        assert gen.step is not None and gen.step.native is None
        tokens = [t for t, _ in run(gen, PROMPT, 40)]
    assert len(tokens) == 40 and gen.cache.shifts >= 2
    guard.check()


@pytest.mark.parametrize("shared_from", [1, 8], ids=["shared-rows", "direct-rows"])
def test_two_slots_step_together_on_the_device(shared_from: int) -> None:
    """The server's batched step over two sequences (the compiled step's rows run eagerly, and the direct
    step's rows), through a shift, with Self-Extend."""
    model = _model("llama", True)
    with DeviceGuard(model) as guard:
        batched = BatchedDecode(model, shared_from=shared_from)
        gens = [Generator(model, ContextShiftCache(model, 40, n_keep=4), seed=s) for s in range(2)]
        for g, n in zip(gens, (30, 25), strict=True):
            g.feed(PROMPT[:n])
        for t in range(20):
            batched([(g, 5 + t) for g in gens])
    assert all(g.cache.shifts >= 1 for g in gens)
    guard.check()


def test_perplexity_and_passkey_stay_on_the_device() -> None:
    """``ppl``'s scoring (whole and in prefill chunks) and ``passkey``'s greedy answer, with Self-Extend and
    with a shift method."""
    model = make_model("llama")
    ids = torch.tensor([PROMPT])
    with DeviceGuard(model) as guard:
        for spec in ("selfextend:G=4,W=16", "plain", "ntk:factor=2"):
            with applied(model, parse_method(spec)):
                token_nll(model, ids)
                token_nll(model, ids, prefill_chunk=16)
        for spec in ("selfextend:G=4,W=16", "shift:ctx=24,keep=4"):
            answer(model, PROMPT, parse_method(spec))
    guard.check()


def test_the_gpu_check_script_runs_dry(tmp_path) -> None:
    """experiments/gpu/check.py, which only a GPU session measures with, runs here on the CPU (its parity
    section against itself, its 8b section on a small shape), so the script a GPU session starts with is
    not broken on arrival."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(root / "experiments/gpu/check.py"), "--dry-run", "--only", "parity,8b,8b-cpu"],
        capture_output=True,
        text=True,
        env={**os.environ, "OUT": str(tmp_path)},
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok   parity two slots" in done.stdout and "failed=[]" in done.stdout
    assert "ok   parity two server slots" in done.stdout, done.stdout
    for check in (
        "8b generate self-extend",
        "8b two slots",
        "8b ppl selfextend",
        "8b chat",
    ):  # the 8B runs, small
        assert f"ok   {check}" in done.stdout, done.stdout
    assert (tmp_path / "gpu_check.jsonl").read_text().count('"ok": true') >= 10


def test_the_gpu_kernel_scripts_run_dry(tmp_path) -> None:
    """check.py's kernel section: check_fused_prefill.py and check_fused_decode.py (a GPU session's numbers
    for the fused kernels) run whole here, their dry runs in Triton's interpreter on a small shape."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton", minversion="3.9")  # 3.6's interpreter fails our loops under numpy 2.4
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(root / "experiments/gpu/check.py"), "--dry-run", "--only", "kernel"],
        capture_output=True,
        text=True,
        env={**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok   kernel prefill" in done.stdout and "ok   kernel decode" in done.stdout, done.stdout
    assert "fused vs reference (float32), last 128 rows" in done.stdout and "fastest tiles" in done.stdout


def test_a_gpu_check_that_raises_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, capsys) -> None:
    """check.py's guard: the device's minutes are few, so one broken path costs its own check only."""
    import importlib.util
    from pathlib import Path

    monkeypatch.setenv("OUT", str(tmp_path))
    path = Path(__file__).resolve().parents[1] / "experiments/gpu/check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_script", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    ran = []

    def broken(n: int) -> None:
        raise ValueError(f"cells {n} on the wrong device\nmore")

    check.guarded("8b prefill", broken, 3)
    check.guarded("8b engine decode", ran.append, "decode")
    assert ran == ["decode"] and check.FAILED == ["8b prefill raised"]
    said = capsys.readouterr().out
    assert "FAIL 8b prefill raised: error=ValueError: cells 3 on the wrong device," in said
    assert "test_device_guard.py:" in said and "broken" in said  # where it raised
    assert '"ok": false' in (tmp_path / "gpu_check.jsonl").read_text()
