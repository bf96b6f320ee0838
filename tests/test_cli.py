"""Command-line behaviour shared by all commands: help with units, one-line errors for bad models."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from transformers import GPT2Config, GPT2LMHeadModel

from selfextend.cli.main import main


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("command", ["info", "generate", "chat", "ppl", "passkey", "plot", "bench", "cache"])
def test_every_command_has_help(command):
    r = invoke(command, "--help")
    assert r.exit_code == 0 and "Usage:" in r.stdout


@pytest.mark.parametrize("command", ["generate", "chat", "ppl", "passkey", "bench"])
def test_threads_on_every_model_command(command):
    assert "--threads" in invoke(command, "--help").stdout
    r = invoke(command, "--threads", "0")
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "--threads" in r.stderr


def test_threads_set_for_torch(tiny_dir):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        r = invoke("generate", "-m", tiny_dir, "--threads", "1", "-p", "hi", "-n", "2", "--temperature", "0")
        assert r.exit_code == 0, r.stderr
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_info_reports_reach(tiny_dir):
    r = invoke("info", tiny_dir, "-g", "4", "-w", "64")
    assert r.exit_code == 0, r.stderr
    assert any(line.split() == ["trained", "window", "256", "tokens"] for line in r.stdout.splitlines())
    assert f"up to {(256 - 64) * 4 + 64:,} tokens" in r.stdout
    # without -w, a model trained on fewer tokens than the default window (1,024) is shown with half its
    # window (it was refused: "window (1024) must be smaller than the model's trained window (256)")
    r = invoke("info", tiny_dir)
    assert (
        r.exit_code == 0
        and "Self-Extend G=4 W=128" in r.stdout
        and f"up to {(256 - 128) * 4 + 128:,}" in r.stdout
    )
    assert "must be smaller" in invoke("info", tiny_dir, "-w", "300").stderr  # a window given is checked
    for command in (["info", tiny_dir], ["generate", "-m", tiny_dir, "-p", "hi", "-g", "4"]):
        r = invoke(*command, "-w", "300")  # the option named and its --help pointed to, as other options'
        line = "error: -w/--window (300) must be smaller than the model's trained window (256) (see '"
        assert r.exit_code == 2 and r.stderr.strip().startswith(line), r.stderr
        assert r.stderr.strip().endswith(f" {command[0]} --help')"), r.stderr  # (CliRunner's: "main")


@pytest.mark.parametrize(
    "args,message",
    [
        (["info", "no-such-model"], "unknown model"),
        (["info", "missing.gguf"], "no such file"),
        (["info", "folder.gguf"], "folder.gguf is a directory, not a GGUF file"),  # was "no such file"
        (["generate", "-m", "no-such-model", "-p", "hi"], "unknown model"),
        (["ppl", "-m", "no-such-model", "-o", "x.jsonl"], "unknown model"),
    ],
)
def test_unknown_models_one_line(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder.gguf").mkdir()
    r = invoke(*args)
    assert r.exit_code != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.parametrize("args", [["info", ""], ["info", "-m", ""], ["info", "-m", " "]])
def test_info_empty_model_name_refused(args):
    """An empty model name is an error, as for every other command, not the default model."""
    r = invoke(*args)
    assert r.exit_code == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no model given"), r.stderr


@pytest.mark.parametrize("native", [True, False], ids=["native kernels", "no kernels"])
def test_info_cache_type_is_generates_default(tiny_dir, monkeypatch, native):
    """info's KV cache lines are for the cells generate uses by default (bf16 where the native decode step
    runs, else the float32 model's own type), in the bytes such a cache allocates."""
    import torch

    from selfextend.generation import settings as generator
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models import load_model

    if not native:
        monkeypatch.setattr(generator, "native_kernels", lambda: None)
    model, _ = load_model(str(tiny_dir), weights="float")
    dtype = generator.default_cache_dtype(model) or torch.float32
    name = {torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
    assert name == ("bf16" if native and generator.native_kernels() is not None else "f32")
    r = invoke("info", tiny_dir, "-g", "4", "-w", "64")
    assert r.exit_code == 0, r.stderr
    cache = ContextShiftCache(model, 256, dtype=dtype)
    allocated = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    line = next(x for x in r.stdout.splitlines() if x.startswith("KV cache at 256 tokens"))
    assert line.split(None, 5)[-1] == f"{allocated / 2**20:,.1f} MiB ({name})", line
    assert f"({name}, generate's default cells)" in r.stdout and "fp16" not in r.stdout


def test_sigterm_handler_given_back():
    """The group's SIGTERM handler (stop like Ctrl-C) lasts only while it runs: an in-process caller such
    as CliRunner keeps its own."""
    import signal

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert invoke("info", "no-such-model").exit_code != 0
        assert invoke("--version").exit_code == 0
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_non_rope_model_refused(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    for args in (["info", tmp_path], ["generate", "-m", tmp_path, "-p", "hi"]):
        r = invoke(*args)
        assert r.exit_code != 0 and "no rotary position embeddings" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_window_beyond_trained_window_refused(tiny_dir):
    r = invoke("info", tiny_dir, "-g", "2", "-w", "256")
    assert r.exit_code != 0 and "trained window" in r.stderr


def test_info_weights_equal_loaded_bytes(tiny_dir):
    from selfextend.models import load_model
    from selfextend.models.weights import run_form_bytes

    r = invoke("info", tiny_dir, "-g", "4", "-w", "64")
    assert r.exit_code == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("weights in memory"))
    for weights, dtype, label in (
        ("int8", "float32", "--weights int8"),
        ("float", "float32", "float32"),
        ("float", "bfloat16", "bfloat16"),
    ):
        model, _ = load_model(str(tiny_dir), dtype=dtype, weights=weights)
        assert f"{run_form_bytes(model) / 2**20:,.1f} MiB ({label})" in line


def test_a_group_without_its_command_prints_its_help():
    """``selfextend cache`` (and ``selfextend``) alone show what they hold, as click's groups do: the
    commands to pick from, not just the usage line as an error."""
    for args, command in ((["cache"], "clear"), ([], "generate")):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2 and "error:" not in r.stderr, r.output
        assert "Commands:" in r.stderr and f"  {command} " in r.stderr, r.output


def test_cache_list_and_clear(tmp_path, monkeypatch):
    from test_models import write_tiny_gguf

    from selfextend.models import load_model

    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path / "cache"))
    assert "(no such folder yet: nothing cached)" in invoke("cache", "list").stdout  # it said "(empty)"
    assert "nothing to free: no folder" in invoke("cache", "clear").stdout  # it said "freed 0.0 MiB"
    assert not (tmp_path / "cache").exists()
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    load_model(str(gguf), weights="int8")
    load_model(str(gguf), dtype="bfloat16")
    listed = invoke("cache", "list").stdout
    assert "int8-float32" in listed and "float-bfloat16" in listed and str(gguf) in listed
    mine = tmp_path / "cache" / "notes.txt"  # $SELFEXTEND_CACHE may name a shared folder: clear kept it?
    mine.write_text("my notes")
    (tmp_path / "cache" / "photos").mkdir()
    (tmp_path / "cache" / "photos" / "a.jpg").write_bytes(b"jpeg")
    r = invoke("cache", "clear")
    assert r.exit_code == 0 and r.stdout.startswith("freed "), r.output
    assert "left 2 not written by selfextend: " in r.stdout and "notes.txt" in r.stdout, r.output
    assert (
        mine.read_text() == "my notes" and (tmp_path / "cache" / "photos" / "a.jpg").read_bytes() == b"jpeg"
    )
    left = invoke("cache", "list").stdout
    assert "int8-float32" not in left and "float-bfloat16" not in left and "tokenizer" not in left, left
    assert left.count("not selfextend's") == 2 and "stale" not in left, left


def test_cache_clear_leaves_a_users_files_in_our_folder_names_and_links(tmp_path, monkeypatch):
    """``$SELFEXTEND_CACHE`` naming a shared folder: a user's GGUF in ``gguf/`` (which holds only the
    files we assemble), a user's folder in ``tokenizer/`` (no marker of ours), and links to a user's
    folders are listed as not selfextend's and survive ``cache clear``: they were deleted, through the links
    too."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SELFEXTEND_CACHE", str(root))
    theirs = {
        root / "gguf" / "my-own-model.gguf": b"GGUF mine",
        root / "tokenizer" / "myproj" / "important.txt": b"keep",
        tmp_path / "usermodels" / "a.gguf": b"GGUF a",
        tmp_path / "userproj" / "p1" / "x.txt": b"x",
    }
    for path, data in theirs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "linked-models").symlink_to(tmp_path / "usermodels")
    (root / "tokenizer" / "linked").symlink_to(tmp_path / "userproj")
    listed = invoke("cache", "list").stdout
    assert listed.count("not selfextend's") == 4 and "assembled GGUF" not in listed, listed
    r = invoke("cache", "clear")
    assert r.exit_code == 0 and "left 4 not written by selfextend" in r.stdout, r.output
    assert all(path.read_bytes() == data for path, data in theirs.items())


def test_cache_list_names_compiled_kernels_not_a_stale_conversion(tmp_path, monkeypatch):
    """The folder the native build compiles into is listed as compiled kernels (it used to read as a stale
    ``float-float32`` conversion), and a conversion-less unknown folder as not selfextend's."""
    from selfextend.native.build import ENV, kernels

    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(ENV, raising=False)
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    library = kernels(source, "one", lambda path: path, "not built: {reason}")
    if library is None:
        pytest.skip("no C compiler here")
    (tmp_path / "cache" / "leftover").mkdir()
    r = invoke("cache", "list")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    built = [line for line in lines if line.rstrip().endswith(str(library.parent))]
    assert len(built) == 1 and "compiled kernels" in built[0] and "stale" not in built[0], r.output
    assert any("not selfextend's" in line and line.rstrip().endswith("leftover") for line in lines), r.output


MISSING = [["info", "{m}"], ["info", "-m", "{m}"], ["generate", "-m", "{m}", "-p", "x"]]


@pytest.mark.parametrize("args", MISSING)
def test_missing_gguf_refused_before_torch_is_imported(args, tmp_path):
    """A .gguf path that is not there is one error line before the seconds of importing torch."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom selfextend.cli.main import main\ntry:\n    main(sys.argv[1:])\n"
        "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)"
    )
    argv = [a.format(m=tmp_path / "missing.gguf") for a in args]
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"], (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "no such file" in r.stderr, r.stderr


def test_info_says_what_a_gpu_here_would_run(tiny_dir, monkeypatch):
    """The GPU row: none on this machine; on a GPU its name and whether the fused kernels take it (triton
    present and compute capability 8.0 or more), each reason said (a GPU simulated: none here)."""
    import importlib.util

    import torch

    from selfextend.core import fused_prefill

    def gpu_line():
        r = invoke("info", tiny_dir, "-g", "4", "-w", "64")
        assert r.exit_code == 0, r.stderr
        return next(x for x in r.stdout.splitlines() if x.startswith("GPU "))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "none that torch sees" in gpu_line()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 90)
    monkeypatch.setattr(fused_prefill, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if importlib.util.find_spec("triton") is not None:  # (the row names its version: triton imported)
        line = gpu_line()
        assert "NVIDIA H200, compute capability 9.0: the fused Triton kernels run (triton " in line, line
    monkeypatch.setattr(fused_prefill, "compute_capability", lambda device: 75)
    assert gpu_line().endswith("they need compute capability 8.0 or more")
    monkeypatch.setattr(fused_prefill, "triton_available", lambda: False)
    assert "triton is not installed" in gpu_line()


def test_dtype_default_follows_the_device(monkeypatch):
    """--dtype unset: float32 on the CPU, bfloat16 on a GPU (float16 on one below compute capability 8.0),
    whichever order --device comes in; a --dtype given wins. A GPU simulated (none here)."""
    import click
    import torch

    from selfextend.cli.options import device_map_option, model_options
    from selfextend.models import default_dtype

    @click.command()
    @model_options
    @device_map_option
    def show(model, dtype, device):
        click.echo(dtype)

    def said(*args):
        r = CliRunner().invoke(show, list(args))
        assert r.exit_code == 0, r.output
        return r.output.strip()

    assert said() == said("--device", "cpu") == "float32"
    assert said("--device", "cuda") == "bfloat16"  # no GPU here: loading would then say so
    assert said("--dtype", "float16", "--device", "cuda") == said("--device", "cuda:1", "--dtype", "float16")
    assert said("--device", "cuda", "--dtype", "float32") == "float32"
    assert said("--device-map", "auto") == "float32"  # no CUDA: the map places on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert said("--device-map", "auto") == said("--device", "cuda") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    assert said("--device", "cuda") == "float16" and default_dtype("cuda:0") == torch.float16
    assert default_dtype("cpu") == default_dtype("mps") == default_dtype("no such") == torch.float32
