"""Milliseconds per decode token of a model (SmolLM2, default weights) through each decode path, side by side.

Paths: ``direct`` (the eager :class:`~selfextend.generation.decode.DecodeStep`, the default: for GGUF block
weights every layer in one native call), ``loop`` (the same step's Python loop over the same kernels),
``torch`` (the same without its native kernels: torch ops, SDPA attention), ``eager`` (the compiled
step's code run eagerly: Gemma 3's path before the direct step served it), ``layer`` (the compiled step
as ``--compile`` runs it: one decoder layer compiled, called per layer), ``layerskip`` (the same with
dynamo's guard evaluation skipped, to see what guards cost), ``whole`` (the whole step compiled
as one graph: minutes to compile, not offered by the CLI). Each ``PATH:TYPE`` names a cache element type
(f32, bf16, f16); ``PATH:TYPE@thread`` times it on a second thread, not the one that loaded the model (as
``serve`` ran its engine before 2026-11-25: OpenMP's idle workers stop spinning once two threads keep
pools on two cores). A cache of 4,096 cells filled with 1,400 prompt tokens; each round times 100 tokens per
path after 5, then rewinds to the prompt; rounds interleave the paths. First-call (compile) seconds are
printed as they happen.

    python experiments/speed/decode_paths.py direct:f32 layer:f32 layer:bf16 [--rounds 3] [--self-extend]
    python experiments/speed/decode_paths.py direct:bf16 eager:f32 --model gemma3-270m
    python experiments/speed/decode_paths.py direct:f32 direct:f32@thread --model gemma3-270m
    python experiments/speed/decode_paths.py loop:bf16 direct:bf16 --self-extend
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import torch

from selfextend.generation.compiled import FastDecode
from selfextend.generation.decode import DecodeStep
from selfextend.generation.generator import Generator
from selfextend.generation.settings import CACHE_DTYPES
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model

FILL, TOKEN = 1400, 5


def step_fn(model: torch.nn.Module, path: str) -> Callable[[Generator], object]:
    """One token at the cache's next position through ``path``."""
    if path == "direct":
        return lambda g: g.step(TOKEN, g.cache)
    if path == "torch":
        step = DecodeStep(model, native=False)
        return lambda g: step(TOKEN, g.cache)
    if path == "loop":
        step = DecodeStep(model)
        step.native_layers = None
        return lambda g: step(TOKEN, g.cache)
    fast = FastDecode(model, compile=path in ("layer", "layerskip"))
    if path == "whole":
        fast.compile, fast.fn = True, torch.compile(fast.step.__call__, dynamic=True)

    def fn(g: Generator) -> object:
        g.make_room(1)
        if path == "layerskip" and fast.compiled:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                out = fast(TOKEN, g.cache)
        else:
            out = fast(TOKEN, g.cache)
        if out is None:
            raise RuntimeError(f"{path}: the step did not serve the token")
        return out

    return fn


def load(name: str, threads: int, self_extend: bool) -> torch.nn.Module:
    """Model ``name`` as ``generate`` runs it (its default weights), ``threads`` threads; Self-Extend G=4,
    W=1024 if set."""
    torch.set_num_threads(threads)
    model, _ = load_model(name, weights="auto")
    if self_extend:
        apply_self_extend(model, group_size=4, window=1024)
    return model


def filled(model: torch.nn.Module, cache_type: str, fill: int = FILL, n_ctx: int = 4096) -> Generator:
    """A generator over ``n_ctx`` cells of ``cache_type`` holding ``fill`` prompt tokens (the same every
    time)."""
    gen = Generator(model, ContextShiftCache(model, n_ctx=n_ctx, n_keep=4, dtype=CACHE_DTYPES[cache_type]))
    gen.feed(torch.randint(100, 40000, (fill,), generator=torch.Generator().manual_seed(0)).tolist())
    return gen


def milliseconds(fn: Callable[[Generator], object], gen: Generator, n: int = 100, fill: int = FILL) -> float:
    """Milliseconds per token of ``n`` tokens through ``fn`` after 5 untimed ones, from ``fill`` cached
    tokens (rewound to them before and after)."""
    for _ in range(5):
        fn(gen)
    gen.rewind(fill)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(gen)
    elapsed = time.perf_counter() - t0
    gen.rewind(fill)
    return elapsed / n * 1000


def on_a_thread(fn: Callable[[Generator], object], gen: Generator) -> float:
    """:func:`milliseconds` measured on a new thread."""
    box: list[float] = []
    thread = threading.Thread(target=lambda: box.append(milliseconds(fn, gen)))
    thread.start()
    thread.join()
    return box[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="PATH:TYPE, e.g. direct:f32 layer:bf16")
    parser.add_argument(
        "--model", default="smollm2-135m", help="a shipped model's name (smollm2-135m, gemma3-270m)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--self-extend", action="store_true", help="Self-Extend G=4, W=1024 on every path")
    args = parser.parse_args()
    model = load(args.model, args.threads, args.self_extend)
    setups = {}
    for name in args.paths:
        path, cache_type = name.removesuffix("@thread").split(":")
        gen = filled(model, cache_type)
        fn = step_fn(model, path)
        t0 = time.perf_counter()
        fn(gen)
        print(f"{name}: first call {time.perf_counter() - t0:.1f} s", flush=True)
        gen.rewind(FILL)
        setups[name] = (fn, gen)
    for r in range(args.rounds):
        timed = {
            name: (on_a_thread if name.endswith("@thread") else milliseconds)(*s)
            for name, s in setups.items()
        }
        shown = ", ".join(f"{name} {ms:.2f}" for name, ms in timed.items())
        print(f"round {r} (ms per token): {shown}", flush=True)


if __name__ == "__main__":
    main()
