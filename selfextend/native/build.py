"""Compiling the native kernels' C sources into shared libraries, once per sources, compiler and CPU.

As inductor compiles its CPU kernels: the system C compiler (``$CC``, else ``cc`` or ``gcc``) with
:data:`FLAGS` (``-O3 -march=native -fopenmp``; no trapping math, so ``floorf`` vectorizes), into a
directory under the cache root. A library is named after everything its code depends on
(:func:`build_key`), what ``-march=native`` targets included, as the compiler itself reports it: a library
built on a CPU with instructions another lacks (AVX-512, SVE) is never loaded there, where it would kill
the process with SIGILL. A build prints one line on stderr (that it compiles, then how long it took), so
whoever times a run can see it; a compiler that hangs is stopped after :data:`COMPILE_TIMEOUT` seconds.
``$SELFEXTEND_NATIVE_FLAGS`` (:data:`FLAGS_ENV`) adds compiler flags to every build, after :data:`FLAGS`
and part of the key: ``-mno-avx512f`` builds the whole native path as a CPU with AVX2 and no AVX-512 runs
it, on one that has AVX-512 (to measure the AVX2 loops there).
It sits below the model loading because the GGUF block layers (:mod:`selfextend.native.quant`) use it as
the decode step's kernels do; :func:`bind` and :data:`TYPES` are what their ctypes bindings share.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from selfextend.core.paths import cache_root

T = TypeVar("T")
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC")
COMPILE_TIMEOUT = 300.0  # seconds a compile may take before the caller falls back to torch ops
QUERY_TIMEOUT = 60.0  # and a question to the compiler (its version, its target)
ENV = "SELFEXTEND_NATIVE"  # "0": no native kernel is built or used (torch ops, reference products)
FLAGS_ENV = "SELFEXTEND_NATIVE_FLAGS"  # compiler flags added to every build (shell words), e.g. -mno-avx512f
TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # element types as the C sources number them


class Sources(NamedTuple):
    """The C files of one library, compiled together, and headers ``generated`` from Python tables (file
    name, text), written beside the build and on its include path: both are part of the key."""

    files: tuple[Path, ...]
    generated: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, source: Path | Sources) -> Sources:
        """``source`` itself, or a single C file as its sources."""
        return source if isinstance(source, Sources) else cls((Path(source),))

    def key_parts(self) -> list[bytes]:
        """Everything the compiled code depends on in the sources: each file, every header (``*.h``) beside
        them, each generated header."""
        folders = sorted({f.parent for f in self.files})
        headers = sorted(h for folder in folders for h in folder.glob("*.h"))
        parts = [p.name.encode() + b"\0" + p.read_bytes() for p in [*self.files, *headers]]
        return parts + [f"{name}\0{text}".encode() for name, text in self.generated]


def bind(fn: Any, argtypes: list[Any], restype: Any) -> Any:
    """``fn`` with its C signature set (ctypes converts and checks the arguments)."""
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def kernels(source: Path | Sources, name: str, make: Callable[[Path], T], missing: str) -> T | None:
    """``make(library)`` of C ``source`` (a file or :class:`Sources`) built as ``name`` into the cache
    root's ``kernels`` folder (:func:`build`), or None where ``$SELFEXTEND_NATIVE`` is ``0`` or it cannot be
    built, then with one warning: ``missing`` with ``{reason}`` replaced by why."""
    if os.environ.get(ENV) == "0":
        return None
    try:
        return make(build(cache_root() / "kernels", source, name))
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        warnings.warn(missing.format(reason=reason), stacklevel=3)
        return None


def build(directory: Path, source: Path | Sources, name: str, extra: tuple[str, ...] = ()) -> Path:
    """The shared library of C ``source`` (a file or :class:`Sources`) in ``directory``
    (``name-<key>.so``), compiled unless already there for these sources, compiler and target
    (:func:`build_key`), with one line on stderr while it compiles and how long it took. ``extra``: flags
    after :data:`FLAGS` (``-mno-avx512f``: a narrower path of the same sources, as the tests build one),
    then those of ``$SELFEXTEND_NATIVE_FLAGS`` (:func:`env_flags`). Raises ``RuntimeError`` (with the
    compiler's message) where it does not compile or takes over :data:`COMPILE_TIMEOUT` seconds."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc, or $CC)")
    sources, extra = Sources.of(source), (*extra, *env_flags())
    target = directory / f"{name}-{build_key(cc, sources, extra)}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    files = ", ".join(f.name for f in sources.files)
    print(f"compiling the {name} kernels ({files}) for this CPU, once ...", end=" ", file=sys.stderr)
    sys.stderr.flush()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:  # then renamed: concurrent builds do not clash
        out = Path(tmp) / target.name
        for header, text in sources.generated:
            (Path(tmp) / header).write_text(text, encoding="utf-8")
        command = [cc, *FLAGS, *extra, f"-I{tmp}", *map(str, sources.files), "-o", str(out), "-lm"]
        try:
            _run(command, COMPILE_TIMEOUT, check=True)
        except RuntimeError:
            print("failed", file=sys.stderr, flush=True)
            raise
        os.replace(out, target)
    print(f"done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return target


def build_key(cc: str, source: Path | Sources, extra: tuple[str, ...] = ()) -> str:
    """What a build depends on: the sources and their headers (:meth:`Sources.key_parts`), the flags, the
    compiler's version and what ``-march=native`` makes it target on this machine (:func:`compiler_target`),
    so a library built for one CPU is never loaded on another (an instruction it lacks would kill the
    process with SIGILL)."""
    key = hashlib.sha256()
    version = _run([cc, "--version"], QUERY_TIMEOUT).stdout
    target = compiler_target(cc, extra)
    for part in (*Sources.of(source).key_parts(), " ".join(FLAGS + extra), version, target):
        key.update(part if isinstance(part, bytes) else part.encode())
    return key.hexdigest()[:16]


def env_flags() -> tuple[str, ...]:
    """The compiler flags of ``$SELFEXTEND_NATIVE_FLAGS``, split as a shell splits words (none: unset)."""
    return tuple(shlex.split(os.environ.get(FLAGS_ENV, "")))


def compiler_target(cc: str, extra: tuple[str, ...] = ()) -> str:
    """What the compiler generates code for under the ``-m`` options of :data:`FLAGS` and ``extra``, on every
    architecture: gcc's resolved target options (``-Q --help=target``) where it has them, and the macros the
    target defines (``-dM -E``: ``__AVX512F__``, ``__ARM_FEATURE_SVE``, ..., which clang gives too).
    RuntimeError where the compiler answers neither."""
    machine = [f for f in FLAGS + extra if f.startswith("-m")]
    options = _run([cc, *machine, "-Q", "--help=target"], QUERY_TIMEOUT)
    macros = _run([cc, *machine, "-dM", "-E", "-x", "c", os.devnull], QUERY_TIMEOUT)
    answers = [p.stdout for p in (options, macros) if p.returncode == 0 and p.stdout.strip()]
    if not answers:
        why = macros.stderr.strip()[-200:]
        raise RuntimeError(f"{cc} does not say what {' '.join(machine)} targets: {why}")
    return "\n".join(answers)


def _run(command: list[str], timeout: float, check: bool = False) -> subprocess.CompletedProcess:
    """``command``'s completed process (text output); RuntimeError where it runs over ``timeout`` seconds or,
    with ``check``, fails (with the end of its message)."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{command[0]} still running after {timeout:g} s: stopped") from None
    if check and proc.returncode != 0:
        raise RuntimeError(f"{command[0]} failed: {proc.stderr.strip()[-500:]}")
    return proc
