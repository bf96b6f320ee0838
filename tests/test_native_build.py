"""Building the native kernels: the library's name follows what the compiler targets (never /proc/cpuinfo),
a build says on stderr that it compiles and how long it took, a compiler that hangs is stopped, and the
decode step falls back to torch ops then.

Fake compilers are shell scripts in front of the real one: they change one answer (the target options) or
hang, and pass everything else through.
"""

from __future__ import annotations

import builtins
import ctypes
import io
import shutil
from pathlib import Path

import pytest

from selfextend.native import build as building
from selfextend.native import decode as native
from selfextend.native.build import build, build_key, compiler_target

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here")
TINY = "int answer(void) { return 42; }\n"


def fake_compiler(tmp_path: Path, body: str) -> str:
    """A compiler script that runs ``body`` (sh) first, then the real compiler with its arguments."""
    script = tmp_path / "fake-cc"
    script.write_text(f'#!/bin/sh\n{body}\nexec {CC} "$@"\n')
    script.chmod(0o755)
    return str(script)


@needs_cc
def test_key_follows_the_compilers_target_not_cpuinfo(tmp_path, monkeypatch) -> None:
    """The key changes with the target the compiler reports and with nothing read from /proc/cpuinfo (whose
    CPU line is ``flags`` on x86 and ``Features`` on ARM): two ARM CPUs with and without SVE differ in what
    ``-march=native`` targets, which is what the key hashes."""
    cc = fake_compiler(tmp_path, 'case "$*" in *--help=target*) echo "$FAKE_TARGET"; exit 0;; esac')
    source = tmp_path / "tiny.c"
    source.write_text(TINY)
    opened: list[str] = []
    for module in (builtins, io):
        real = module.open
        monkeypatch.setattr(
            module, "open", lambda f, *a, real=real, **kw: opened.append(str(f)) or real(f, *a, **kw)
        )
    keys = {}
    for target in ("-march= armv8.2-a+sve", "-march= armv8.2-a", "-march= armv8.2-a+sve"):
        monkeypatch.setenv("FAKE_TARGET", target)
        keys.setdefault(target, set()).add(build_key(cc, source))
    assert len(keys["-march= armv8.2-a+sve"]) == 1  # the same target, the same key
    assert keys["-march= armv8.2-a+sve"] != keys["-march= armv8.2-a"]
    assert not any("cpuinfo" in f for f in opened)


@needs_cc
def test_the_real_compiler_says_what_it_targets() -> None:
    """gcc and clang alike define the target's macros (``__x86_64__`` / ``__aarch64__``, and the ISA
    extensions), which are part of the key."""
    assert "#define __" in compiler_target(CC)


def test_a_compiler_that_cannot_say_builds_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false does not say what -march=native targets"):
        build(tmp_path, native.SOURCE, "native")
    assert list(tmp_path.iterdir()) == []


@needs_cc
def test_build_reports_on_stderr_once(tmp_path, monkeypatch, capfd) -> None:
    """A source and a name (the quantized kernels' source can be built the same way): one line on stderr
    while it compiles, with the time it took; nothing the second time (the library is there)."""
    monkeypatch.delenv("CC", raising=False)
    source = tmp_path / "tiny.c"
    source.write_text(TINY)
    library = build(tmp_path / "kernels", source, "tiny")
    assert library.name.startswith("tiny-") and library.exists()
    err = capfd.readouterr().err
    assert err.startswith("compiling the tiny kernels (tiny.c) for this CPU, once ... done in ")
    assert err.endswith(" s\n") and err.count("\n") == 1
    assert build(tmp_path / "kernels", source, "tiny") == library
    assert capfd.readouterr().err == ""


@needs_cc
def test_a_compiler_that_hangs_is_stopped(tmp_path, monkeypatch, capfd) -> None:
    """Past the timeout the build stops with a clear error, leaves nothing behind, and the decode step gets
    no kernels (torch ops) with one warning saying why."""
    monkeypatch.setenv("CC", fake_compiler(tmp_path, 'case "$*" in *-shared*) exec sleep 30;; esac'))
    monkeypatch.setattr(building, "COMPILE_TIMEOUT", 0.5)
    with pytest.raises(RuntimeError, match="still running after 0.5 s"):
        build(tmp_path / "kernels", native.SOURCE, "native")
    assert "compiling the native kernels" in capfd.readouterr().err
    assert list((tmp_path / "kernels").glob("**/*.so")) == []
    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path))
    native.native_kernels.cache_clear()
    try:
        with pytest.warns(UserWarning, match="not built .* still running after 0.5 s.*torch ops"):
            assert native.native_kernels() is None
    finally:
        native.native_kernels.cache_clear()


@needs_cc
def test_a_cache_it_cannot_write_is_said_as_the_reason(tmp_path, monkeypatch) -> None:
    """The GGUF products' kernels cannot be built where the cache root cannot be written: the warning
    says why (it said only "using the reference products", so the fallback read as a missing compiler)."""
    from selfextend.native import quant

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SELFEXTEND_CACHE", str(blocker / "cache"))
    with pytest.warns(UserWarning, match=r"GGUF block products not built \(.*a-file.*\); using the"):
        assert quant.quant_kernels.__wrapped__() is None


@needs_cc
def test_generate_builds_the_kernels_before_the_clock_starts(tiny_dir, tmp_path, monkeypatch) -> None:
    """With an empty cache, ``generate -n 5`` says on stderr that it compiles the kernels, and they are built
    before the generation loop (which holds the clock of the reported rates) is entered: a first run's rate
    never includes the build."""
    from click.testing import CliRunner

    from selfextend.cli.main import main
    from selfextend.generation import generator

    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    native.native_kernels.cache_clear()
    built_at_start = []
    real_run = generator.run

    def run(*args, **kwargs):
        built_at_start.append(native.native_kernels.cache_info().currsize == 1)
        built_at_start.append(bool(list((tmp_path / "kernels").glob("native-*.so"))))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(generator, "run", run)
    try:
        r = CliRunner().invoke(main, ["generate", "-m", str(tiny_dir), "-p", "hi", "-n", "5", "--ignore-eos"])
    finally:
        native.native_kernels.cache_clear()
    assert r.exit_code == 0, r.output
    assert built_at_start == [True, True]
    lines = r.stderr.strip().splitlines()
    build = [i for i, line in enumerate(lines) if line.startswith("compiling the native kernels")]
    assert len(build) == 1 and " done in " in lines[build[0]]
    assert lines[-1].startswith("5 tokens in") and build[0] < len(lines) - 1


@needs_cc
def test_flags_from_the_environment_reach_the_compiler_and_the_key(tmp_path, monkeypatch) -> None:
    """``$SELFEXTEND_NATIVE_FLAGS`` is added to every build's command (split as shell words) and is part of
    the key: the same source built with other flags is another library; ``-mno-avx512f`` compiles without
    the AVX-512 macros (on any x86 CPU)."""
    monkeypatch.delenv("CC", raising=False)
    source = tmp_path / "flagged.c"
    source.write_text("#ifndef ANSWER\n#define ANSWER 42\n#endif\nint answer(void) { return ANSWER; }\n")
    plain = build(tmp_path / "kernels", source, "tiny")
    monkeypatch.setenv(building.FLAGS_ENV, "-DANSWER=41  -O2")
    assert building.env_flags() == ("-DANSWER=41", "-O2")
    flagged = build(tmp_path / "kernels", source, "tiny")
    assert flagged != plain
    assert [ctypes.CDLL(str(lib)).answer() for lib in (plain, flagged)] == [42, 41]
    if "__x86_64__" in compiler_target(CC):
        assert "__AVX512F__" not in compiler_target(CC, ("-mno-avx512f",))
