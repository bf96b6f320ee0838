"""Where a GGUF load's memory goes: resident memory after each stage of ``load_model``, each stage's peak.

Each stage (the GGUF check with its config, the tokenizer's conversion, the weights, the tied head,
writing the cache entry; from the cache: reading the run form) is wrapped where it is called so that it
prints the process's VmRSS (anonymous and file-backed) when it ends and its own high-water mark: the mark
(VmHWM) is reset before each stage by writing 5 to /proc/self/clear_refs (Linux). "before X" lines
show what happened between two stages (e.g. the tokenizer read from its files). CPU seconds are
per stage. tracemalloc cannot see this: the memory is torch's, numpy's and the Rust tokenizer's.

    python experiments/memory/load_stages.py gemma3-270m --weights int8    # cold: an empty cache
    python experiments/memory/load_stages.py gemma3-270m --dtype bfloat16 --cache DIR   # DIR kept: warm
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024  # MiB
    raise KeyError(field)


class Stages:
    """Prints one line per stage and resets the high-water mark for the next."""

    def __init__(self) -> None:
        self.cpu = time.process_time()
        self.worst = 0

    def report(self, label: str) -> None:
        now = time.process_time()
        peak = _vm("VmHWM")
        self.worst = max(self.worst, peak)
        print(
            f"{label:32s} RSS {_vm('VmRSS'):6d} MiB (anon {_vm('RssAnon'):5d}, file {_vm('RssFile'):4d})"
            f"   stage peak {peak:6d} MiB   CPU {now - self.cpu:5.1f} s",
            flush=True,
        )
        self.cpu = now
        Path("/proc/self/clear_refs").write_text("5")

    def wrap(self, module: Any, name: str) -> None:
        inner = getattr(module, name)

        @functools.wraps(inner)
        def staged(*args: Any, **kwargs: Any) -> Any:
            self.report(f"  before {name}")
            result = inner(*args, **kwargs)
            self.report(name)
            return result

        setattr(module, name, staged)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="an alias or a .gguf path")
    parser.add_argument("--weights", default="float", choices=["float", "int8", "int4"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--cache", type=Path, default=None, help="cache folder (default: a fresh one, removed)"
    )
    args = parser.parse_args()
    cache = args.cache or Path(tempfile.mkdtemp(prefix="selfextend-stages-"))
    os.environ["SELFEXTEND_CACHE"] = str(cache)
    stages = Stages()
    Path("/proc/self/clear_refs").write_text("5")
    import torch  # noqa: F401

    from selfextend import models
    from selfextend.hf.patch import apply_self_extend  # noqa: F401  (what every command imports)
    from selfextend.models import diskcache, load, weights

    stages.report("imports")
    # each stage wrapped where it is called from: (module that calls it, its name)
    for module, name in (
        (diskcache, "read_gguf"),  # the GGUF check and its config, the tensor table kept
        (diskcache, "_converted_tokenizer"),
        (diskcache, "_convert_gguf"),
        (diskcache, "_write_entry"),
        (load, "load_run_form"),
        (weights, "_tie_head"),
    ):
        stages.wrap(module, name)
    try:
        models.load_model(args.model, dtype=args.dtype, weights=args.weights)
        stages.report("load_model returned")
    finally:
        if args.cache is None:
            shutil.rmtree(cache, ignore_errors=True)
    print(f"highest stage peak: {stages.worst} MiB")


if __name__ == "__main__":
    main()
