"""The compiled decode step against the model's own forward, through context shifts, with and without
Self-Extend, on tiny models of every family it serves.

The oracle is transformers' forward over the same :class:`ContextShiftCache` (the eager path of
``Generator``), which shares no attention code with the step. The step runs eagerly for every family
(cheap); compiled (``compile`` marker: minutes on two cores) for a Llama and a Gemma 3, once per model and
attention, counting the graphs dynamo builds.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_model, tiny_gemma3

from selfextend.generation import compiled
from selfextend.generation.cells import StepCells
from selfextend.generation.compiled import FastDecode, why_not
from selfextend.generation.generator import Generator
from selfextend.hf.patch import apply_self_extend, remove_self_extend
from selfextend.kv.cache import ContextShiftCache

N_CTX, N_KEEP, PROMPT, TOKENS = 40, 3, 10, 70  # 80 tokens through a 40-cell cache: 3 shifts
GROUP, WINDOW = 3, 7


def _model(family: str) -> torch.nn.Module:
    if family == "gemma3":
        return tiny_gemma3(["sliding_attention", "full_attention", "sliding_attention"], sliding_window=6)
    return make_model(family)


def _ids(seed: int = 0) -> list[int]:
    return torch.randint(3, 90, (PROMPT + TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()


def _logits(model: torch.nn.Module, fast: FastDecode | None, ids: list[int]) -> tuple[torch.Tensor, int, int]:
    """Teacher-forced logits after every token past the prompt, the shifts made and the steps ``fast``
    served (the others, and all without ``fast``, through the model's forward)."""
    gen = Generator(model, ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP), direct_decode=False)
    gen.feed(ids[:PROMPT])
    out, served = [], 0
    for t in ids[PROMPT:]:
        gen.cache.make_room(1)
        logits = fast(t, gen.cache) if fast is not None else None
        if logits is None:
            logits = gen.write([t])
        else:
            served += 1
        out.append(logits)
    return torch.stack(out), gen.cache.shifts, served


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("extend", [False, True])
def test_eager_step_matches_forward(family: str, extend: bool) -> None:
    model = _model(family)
    if extend:
        apply_self_extend(model, GROUP, WINDOW)
    ids = _ids()
    want, shifts, _ = _logits(model, None, ids)
    got, shifts_fast, served = _logits(model, FastDecode(model, compile=False), ids)
    assert shifts == shifts_fast >= 3
    assert served >= TOKENS // 2  # the rest: the last slot of a layer, a sliding layer moving its cells
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_self_extend_changes_the_logits() -> None:
    """The grouped scores are in play: with Self-Extend the step's logits differ from plain ones."""
    model, ids = _model("llama"), _ids()
    plain, _, _ = _logits(model, FastDecode(model, compile=False), ids)
    apply_self_extend(model, GROUP, WINDOW)
    extended, _, _ = _logits(model, FastDecode(model, compile=False), ids)
    remove_self_extend(model)
    assert (plain - extended).abs().max() > 1e-2


def test_sliding_cells_hold_what_the_next_token_attends() -> None:
    """The cells handed to the step for a sliding layer hold every position the next token may attend
    (the kept ones and the last ``window - 1``) and nothing at or after its own position."""
    model = _model("gemma3")
    gen = Generator(model, ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP), direct_decode=False)
    cells = StepCells(gen.cache)
    layer = gen.cache.layers[0]  # sliding
    checked = 0
    for t in _ids(1)[:80]:
        gen.feed([t])
        prepared = cells.prepare()
        if prepared is None:
            continue
        p = gen.cache.n_past  # the next token's position
        held = set(prepared.positions[0][:-1].tolist())
        needed = {q for q in range(p) if q < N_KEEP or q > p - layer.window}
        assert needed <= held and max(held) < p
        assert int(prepared.positions[0][-1]) == p == int(prepared.positions[1][-1])
        checked += 1
    assert checked > 40


def test_unsupported_models_are_named() -> None:
    assert why_not(make_model("phi3")) == "model type phi3"
    assert why_not(make_model("llama")) is None


def test_compile_failure_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A compiler that fails: one warning line, then the other paths decode (same tokens as without)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no compiler here\nsecond line")

        return run

    monkeypatch.setattr(compiled.torch, "compile", broken)
    model, lines = make_model("llama"), []
    fast = FastDecode(model, compile=True, notify=lines.append)
    cache = ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP)
    Generator(model, cache).feed(_ids()[:PROMPT])
    assert fast(5, cache) is None and fast(5, cache) is None
    assert len(lines) == 2 and lines[1].startswith("warning: compiling the decode step failed")
    assert "second line" not in lines[1]


@pytest.fixture(scope="module")
def inductor_dir(tmp_path_factory: pytest.TempPathFactory):
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


@pytest.mark.compile
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_compiled_step_matches_forward(family: str, inductor_dir) -> None:
    """Compiled: the model's logits to 1e-4 through >= 3 shifts, plain and with Self-Extend, one graph of
    the layer function for each kind of layer (sliding, full, grouped) whatever the layer, and none more as
    the cache fills, shifts, or Self-Extend groups keys."""
    from torch._dynamo.utils import counters

    model = _model(family)
    fast = FastDecode(model, compile=True, notify=lambda line: None)
    seen: set[tuple[int | None, bool]] = set()  # kinds of layer compiled so far: (window, no grouping)
    for extend in (False, True):
        if extend:
            apply_self_extend(model, GROUP, WINDOW)
        ids = _ids(2)
        want, shifts, _ = _logits(model, None, ids)
        graphs = counters["stats"]["unique_graphs"]
        got, _, served = _logits(model, fast, ids)
        kinds = {(w, g is None) for w, g in zip(fast.step.windows, fast.grouped_tables(N_CTX), strict=True)}
        assert counters["stats"]["unique_graphs"] - graphs == len(kinds - seen)
        seen |= kinds
        assert shifts >= 3 and served >= TOKENS // 2
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _cache_logits(model: torch.nn.Module, dtype: torch.dtype | None, fast: FastDecode | None) -> torch.Tensor:
    gen = Generator(
        model, ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP, dtype=dtype), direct_decode=False
    )
    gen.feed(_ids()[:PROMPT])
    out = []
    for t in _ids()[PROMPT:]:
        gen.cache.make_room(1)
        logits = fast(t, gen.cache) if fast is not None else None
        out.append(gen.write([t]) if logits is None else logits)
    return torch.stack(out)


# Rounding K/V to bf16 (8 significant bits) or f16 (11) moves the logits of these tiny models by at most
# about 1.2% (bf16) and 0.12% (f16) of their largest magnitude through >= 3 shifts with Self-Extend.
CACHE_TOLERANCE = {torch.bfloat16: 0.02, torch.float16: 0.0025}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_cache_close_to_float32(family: str, dtype: torch.dtype) -> None:
    """A bf16/f16 cache against a float32 one (the model's forward reads it upcast), within the stated
    fraction of the logits' scale, the same greedy tokens; the step reads the same cells as the forward, to
    the same budget and with the same greedy tokens (the forward's grouped-key memo is kept in the cells'
    type, rounded once more after its rotation; the compiled step rotates the cells in float32)."""
    model = _model(family)
    apply_self_extend(model, GROUP, WINDOW)
    want = _cache_logits(model, None, None)
    forward = _cache_logits(model, dtype, None)
    step = _cache_logits(model, dtype, FastDecode(model, compile=False))
    assert (forward - want).abs().max() <= CACHE_TOLERANCE[dtype] * want.abs().max()
    assert torch.equal(forward.argmax(-1), want.argmax(-1))
    assert (step - forward).abs().max() <= CACHE_TOLERANCE[dtype] * want.abs().max()
    assert torch.equal(step.argmax(-1), forward.argmax(-1))


def test_generate_compile_flag_falls_back_in_one_line(
    tiny_dir, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """``generate --compile`` with a compiler that fails: one warning line on stderr, the text still comes,
    and the same text as ``--no-compile`` (greedy)."""
    from click.testing import CliRunner

    from selfextend.cli.main import main

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kw: lambda *a: 1 / 0)
    args = [
        "generate",
        "-m",
        str(tiny_dir),
        "-p",
        "hi",
        "-n",
        "8",
        "--ignore-eos",
        "--cache-type",
        "bf16",
        "--temperature",
        "0",
    ]
    eager = CliRunner().invoke(main, [*args, "--no-compile"])
    failed = CliRunner().invoke(main, [*args, "--compile"])
    assert eager.exit_code == 0 and failed.exit_code == 0, failed.output
    warnings = [line for line in failed.stderr.splitlines() if "compiling the decode step failed" in line]
    assert len(warnings) == 1 and "ZeroDivisionError" in warnings[0]
    assert failed.stdout == eager.stdout


def test_decode_settings_defaults() -> None:
    """Without the compiled step, bf16 cells where the native direct step decodes (a float32 Llama or Gemma 3
    on the CPU, plain or Self-Extend), the model's dtype for a model it does not serve or without the native
    kernels; the model's dtype with the compiled step; the CLI's names are the library's."""
    from selfextend.cli.generation_options import CACHE_TYPES
    from selfextend.core.validate import ValidationError
    from selfextend.generation.settings import CACHE_DTYPES, decode_settings
    from selfextend.native.decode import native_kernels

    model = make_model("llama")
    native = torch.bfloat16 if native_kernels() is not None else None
    assert tuple(CACHE_DTYPES) == CACHE_TYPES
    assert decode_settings(model, True) == (True, None)
    assert decode_settings(model, False) == (False, native)
    assert decode_settings(tiny_gemma3(["sliding_attention", "full_attention"], 6), False) == (False, native)
    assert decode_settings(make_model("phi3"), False) == (False, None)
    apply_self_extend(model, GROUP, WINDOW)
    assert decode_settings(model, False) == (False, native)
    assert decode_settings(model, True, "f32") == (True, torch.float32)
    assert decode_settings(model, None, "bf16") == (False, torch.bfloat16)  # conftest: compiling never pays
    with pytest.raises(ValidationError, match="cache type"):
        decode_settings(model, True, "q8_0")


def test_compile_on_a_gpu_is_the_captured_step(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """--compile on a GPU, where the step is captured as a CUDA graph (simulated: the captured step said
    to serve the model): not compiled, said once on stderr; on the CPU it is compiled as asked."""
    from selfextend.generation import graphed
    from selfextend.generation.settings import decode_settings

    model = make_model("llama")
    assert decode_settings(model, True)[0] and not capsys.readouterr().err
    monkeypatch.setattr(graphed, "graphed_serves", lambda m: True)
    assert decode_settings(model, True) == (False, decode_settings(model, False)[1])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--compile is for the CPU" in err, err


def test_compile_default_is_opt_in_and_only_for_served_families(monkeypatch: pytest.MonkeyPatch) -> None:
    from selfextend.generation.compiled import compile_pays

    assert not compile_pays(make_model("llama"))  # conftest: SELFEXTEND_COMPILE=0
    monkeypatch.delenv("SELFEXTEND_COMPILE")
    assert not compile_pays(make_model("llama"))  # opt-in until it is shown to pay
    monkeypatch.setenv("SELFEXTEND_COMPILE", "1")
    assert compile_pays(make_model("llama")) and not compile_pays(make_model("phi3"))


def test_inductor_cache_dir_is_ours_unless_the_user_names_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """torch writes its own default into $TORCHINDUCTOR_CACHE_DIR when parts of it are imported: that value
    counts as unset (the graphs go under the selfextend cache root); a folder the user names is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from selfextend.generation.compiled import inductor_cache_dir
    from selfextend.models.sources import cache_root

    ours = str(cache_root() / "inductor")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert inductor_cache_dir() == ours
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert inductor_cache_dir() == ours
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert inductor_cache_dir() == str(tmp_path)
