"""Speed and memory, measured side by side: prefill, decode, and endless generation with context shift.

Variants run interleaved (every repeat goes through all of them in turn) so that machine noise
hits all alike, and the table reports medians and ratios to the plain model from the same run.
Peak memory: on CUDA the allocator's peak; on CPU the process's resident high-water mark,
reset before each case after returning freed memory to the system, minus the resident size
at the start of the case (so it is the memory the case itself added).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from selfextend.core.validate import check_int
from selfextend.generation.generator import Generator
from selfextend.generation.settings import decode_settings
from selfextend.hf.facts import cache_kwargs
from selfextend.hf.patch import REFERENCE_IMPLEMENTATION, apply_self_extend, remove_self_extend
from selfextend.kv.cache import ContextShiftCache
from selfextend.models.heap import release_free_memory

PREFILL_VARIANTS = ("plain", "selfextend", "reference")
DECODE_VARIANTS = ("plain", "selfextend")


def status_kib(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM ...) in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class MemoryMeter:
    """Peak memory a block adds: CUDA allocator peak, or Linux resident high-water mark on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu_ok = device.type == "cpu" and Path("/proc/self/clear_refs").exists()

    @contextmanager
    def measure(self) -> Iterator[dict]:
        result: dict = {}
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            yield result
            torch.cuda.synchronize(self.device)
            result["peak_mib"] = (torch.cuda.max_memory_allocated(self.device) - base) / 2**20
        elif self.cpu_ok:
            release_free_memory()  # give freed memory back, so reuse cannot hide a peak
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            base = status_kib("VmRSS")
            yield result
            result["peak_mib"] = (status_kib("VmHWM") - base) / 1024
        else:
            yield result
            result["peak_mib"] = float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def variant(model: nn.Module, name: str, group_size: int, window: int) -> Iterator[None]:
    """The model as ``plain``, ``selfextend`` (ours) or ``reference`` (full-matrix Self-Extend)."""
    if name == "plain":
        yield
        return
    impl = REFERENCE_IMPLEMENTATION if name == "reference" else "selfextend"
    apply_self_extend(model, group_size, window, implementation=impl)
    try:
        yield
    finally:
        remove_self_extend(model)


@dataclass
class BenchConfig:
    prefill_lengths: list[int]
    decode_lengths: list[int]
    group_size: int = 4
    window: int = 1024
    repeats: int = 2
    decode_steps: int = 16
    reference_max: int = 8192
    endless_ctx: int = 2048
    endless_tokens: int = 2000
    endless_keep: int = 4
    endless_plain_tokens: int = 256  # plain decoding at the average fill: tokens timed
    compile: bool = False  # decode through the compiled step (generation.compiled)
    cache_type: str | None = None  # --cache-type (None: decode_settings' default for each variant as it runs)

    def __post_init__(self) -> None:
        """Every setting checked (:class:`~selfextend.core.validate.ValidationError`), so no case runs zero
        times or loops on a nonsense count."""
        from selfextend.core.positions import validate
        from selfextend.evaluation.lengths import check_lengths

        self.prefill_lengths = check_lengths(self.prefill_lengths, "prefill lengths")
        self.decode_lengths = check_lengths(self.decode_lengths, "decode lengths")
        self.group_size, self.window = validate(self.group_size, self.window)
        self.repeats = check_int(self.repeats, "repeats", 1)
        self.decode_steps = check_int(self.decode_steps, "decode steps", 1)
        self.reference_max = check_int(self.reference_max, "reference max", 0)
        self.endless_ctx = check_int(self.endless_ctx, "endless ctx", 2)
        self.endless_tokens = check_int(self.endless_tokens, "endless tokens", 0)
        self.endless_keep = check_int(self.endless_keep, "endless keep", 0, self.endless_ctx - 2)
        self.endless_plain_tokens = check_int(self.endless_plain_tokens, "endless plain tokens", 1)


def _tokens(model: nn.Module, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(100, vocab - 1, (1, n), generator=g).to(next(model.parameters()).device)


def average_fill(ctx: int, keep: int) -> int:
    """The average cells in use of endless generation: the fill oscillates between about ctx/2 and ctx."""
    return (ctx + keep + (ctx - keep) // 2) // 2


def generator_for(model: nn.Module, cfg: BenchConfig, n_ctx: int) -> Generator:
    """A generator over a fresh context-shift cache of ``n_ctx`` cells, decoding as ``cfg`` says."""
    _, dtype = decode_settings(model, cfg.compile, cfg.cache_type)
    cache = ContextShiftCache(model, n_ctx=n_ctx, n_keep=cfg.endless_keep, dtype=dtype)
    return Generator(model, cache, compile=cfg.compile)


def _greedy_seconds(gen: Generator, logits: torch.Tensor, n_tokens: int) -> float:
    """Seconds to decode ``n_tokens`` greedily through ``gen``, starting from ``logits``."""
    _sync(gen.device)
    t0 = time.perf_counter()
    for _ in gen.decode(logits, n_tokens):
        pass
    _sync(gen.device)
    return time.perf_counter() - t0


@torch.no_grad()
def bench_prefill(model: nn.Module, cfg: BenchConfig, meter: MemoryMeter) -> Iterator[dict]:
    """Time and peak memory of one prefill per (repeat, length, variant), interleaved.

    Each variant first runs once at the shortest length, untimed: a first call pays one-time costs
    (allocations, kernel set-up) that would otherwise land on whichever case runs first.
    """
    device = next(model.parameters()).device
    warm_up = _tokens(model, cfg.prefill_lengths[0])
    for name in PREFILL_VARIANTS:
        if name == "reference" and warm_up.shape[1] > cfg.reference_max:
            continue
        with variant(model, name, cfg.group_size, cfg.window):
            model(warm_up, logits_to_keep=1)
    for rep in range(cfg.repeats):
        for length in cfg.prefill_lengths:
            ids = _tokens(model, length)
            for name in PREFILL_VARIANTS:
                if name == "reference" and length > cfg.reference_max:
                    continue
                with variant(model, name, cfg.group_size, cfg.window), meter.measure() as mem:
                    _sync(device)
                    t0 = time.perf_counter()
                    model(ids, logits_to_keep=1)
                    _sync(device)
                    seconds = time.perf_counter() - t0
                yield {
                    "case": "prefill",
                    "variant": name,
                    "length": length,
                    "repeat": rep,
                    "seconds": seconds,
                    "peak_mib": mem["peak_mib"],
                }


@torch.no_grad()
def bench_decode(model: nn.Module, cfg: BenchConfig) -> Iterator[dict]:
    """Milliseconds per decode step over ``length`` cells, plain against Self-Extend: through the engine's
    own step (the generator over a context-shift cache, what generate, chat and serve run), the cells
    filled by a prefill first and one token decoded untimed."""
    for rep in range(cfg.repeats):
        for length in cfg.decode_lengths:
            ids = _tokens(model, length).tolist()[0]
            for name in DECODE_VARIANTS:
                with variant(model, name, cfg.group_size, cfg.window):
                    gen = generator_for(model, cfg, length + cfg.decode_steps + 2)
                    logits = gen.feed(ids)
                    _greedy_seconds(gen, logits, 1)  # warm-up step
                    seconds = _greedy_seconds(gen, gen.last_logits, cfg.decode_steps)
                    ms = seconds * 1000 / cfg.decode_steps
                yield {"case": "decode", "variant": name, "length": length, "repeat": rep, "ms_per_token": ms}


@torch.no_grad()
def bench_endless(model: nn.Module, cfg: BenchConfig, rss: Callable[[], float]) -> Iterator[dict]:
    """Tokens/s and memory of generation through a context-shift cache, against plain decoding at the
    same average cache fill, and the time one shift takes."""
    device = next(model.parameters()).device
    ctx, keep = cfg.endless_ctx, cfg.endless_keep
    average = average_fill(ctx, keep)
    for rep in range(cfg.repeats):
        gen = generator_for(model, cfg, ctx)
        ids = _tokens(model, ctx // 2, seed=rep).tolist()[0]
        logits = gen.feed(ids)
        rss_start = rss()
        seconds = _greedy_seconds(gen, logits, cfg.endless_tokens)
        yield {
            "case": "endless",
            "variant": "shift",
            "length": ctx,
            "repeat": rep,
            "tokens_per_s": cfg.endless_tokens / seconds,
            "shifts": gen.cache.shifts,
            "rss_start_mib": rss_start,
            "rss_end_mib": rss(),
        }
        # plain decoding: the same loop and decode path, in a cache too large to ever shift
        steps = cfg.endless_plain_tokens
        gen = generator_for(model, cfg, average + steps + 1)
        logits = gen.feed(_tokens(model, average, seed=rep).tolist()[0])
        seconds = _greedy_seconds(gen, logits, steps)
        yield {
            "case": "endless",
            "variant": "plain",
            "length": average,
            "repeat": rep,
            "tokens_per_s": steps / seconds,
        }
        shift_cache = ContextShiftCache(model, n_ctx=ctx, n_keep=keep)
        model(
            _tokens(model, ctx - 1, seed=rep),
            **cache_kwargs(model, shift_cache),
            use_cache=True,
            logits_to_keep=1,
        )
        _sync(device)
        t0 = time.perf_counter()
        shift_cache.make_room(2)
        _sync(device)
        yield {
            "case": "shift",
            "variant": "shift",
            "length": ctx,
            "repeat": rep,
            "ms_per_shift": (time.perf_counter() - t0) * 1000,
        }


def summarize(records: list[dict]) -> list[dict]:
    """Medians per (case, variant, length), with each variant's ratio to plain at the same length (generate
    and first-token: to llama.cpp, of the medians and per round, ``round_ratios``; speculative: with the
    drafts' acceptance and the tokens a pass wrote)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["case"], r["variant"], r["length"]), []).append(r)
    rows = []
    metric = {
        "prefill": "seconds",
        "decode": "ms_per_token",
        "endless": "tokens_per_s",
        "shift": "ms_per_shift",
        "generate": "tokens_per_s",
        "first-token": "seconds",
        "speculative": "tokens_per_s",
    }
    for (case, name, length), rs in sorted(groups.items()):
        row = {"case": case, "variant": name, "length": length, "runs": len(rs)}
        if "weights" in rs[0]:  # a variant's own weights (generate, first-token)
            row["weights"] = rs[0]["weights"]
        for key in (
            *("seconds", "peak_mib", "ms_per_token", "tokens_per_s", "ms_per_shift", "mb_per_token"),
            *("acceptance", "tokens_per_pass"),
        ):
            values = [r[key] for r in rs if key in r]
            if values:
                row[key] = statistics.median(values)
        rates = [r["tokens_per_s"] for r in rs if "tokens_per_s" in r]
        if len(rates) > 1:
            row["spread"] = (max(rates) - min(rates)) / statistics.median(rates)  # (max - min) / median
        if "mb_per_token" in row:
            row["gb_per_s"] = row["mb_per_token"] * row["tokens_per_s"] / 1e3
        rows.append(row)
    for row in rows:
        key = metric[row["case"]]
        if row["case"] in ("prefill", "decode", "speculative"):
            base = next(
                (
                    b
                    for b in rows
                    if b["case"] == row["case"] and b["variant"] == "plain" and b["length"] == row["length"]
                ),
                None,
            )
            if base and row["variant"] != "plain":
                row["ratio"] = row[key] / base[key]
                if "peak_mib" in row and base.get("peak_mib"):
                    row["memory_ratio"] = row["peak_mib"] / base["peak_mib"]
        elif row["case"] == "endless" and row["variant"] == "shift":
            base = next((b for b in rows if b["case"] == "endless" and b["variant"] == "plain"), None)
            if base:
                row["ratio"] = row[key] / base[key]
        elif row["case"] in ("generate", "first-token") and row["variant"] != "llama.cpp":
            base = next(
                (
                    b
                    for b in rows
                    if b["case"] == row["case"]
                    and b["variant"] == "llama.cpp"
                    and b["length"] == row["length"]
                ),
                None,
            )
            if base:
                row["ratio"] = row[key] / base[key]
                theirs = {r["repeat"]: r[key] for r in groups[row["case"], "llama.cpp", row["length"]]}
                ours = groups[row["case"], row["variant"], row["length"]]
                row["round_ratios"] = [r[key] / theirs[r["repeat"]] for r in ours if r["repeat"] in theirs]
    return rows
