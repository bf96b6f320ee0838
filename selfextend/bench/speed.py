"""Generation speed against llama.cpp on the same GGUF: tokens/s with the bytes each token reads, and the
time to the first token of long prompts. Rounds are interleaved (every repeat runs every variant in turn)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from selfextend.bench.runner import (
    BenchConfig,
    _greedy_seconds,
    _sync,
    _tokens,
    average_fill,
    generator_for,
    variant,
)
from selfextend.kv.cache import ContextShiftCache
from selfextend.models.blocks import BlockLinear
from selfextend.native.stream import stream_probe


def cell_bytes(cache: ContextShiftCache, fill: int) -> int:
    """Bytes of the K/V cells one decode step reads at ``fill`` (a sliding layer at most its capacity)."""
    return sum(
        2 * layer.keys[..., : min(fill, layer.capacity), :].numel() * layer.keys.element_size()
        for layer in cache.layers
    )


def bytes_per_token(model: nn.Module, cache: ContextShiftCache, fill: int) -> int:
    """Bytes one decode step reads at least: every weight once (of an embedding that is not also the output
    head, one row) and the K/V cells in use at ``fill``."""
    table = model.get_input_embeddings()
    embed = getattr(table, "weight", None)
    embed = table.blocks if embed is None else embed  # a GGUF table held as blocks: rows of bytes
    # by address: a tied table and head may be two tensors over the same bytes (a K-quant head kept as
    # stored rows, on a CPU whose interleaved form is not faster)
    held = {t.data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    weights = sum(held.values())
    head = model.get_output_embeddings()
    head_rows = getattr(head, "weight", None)
    head_rows = getattr(head, "blocks", None) if head_rows is None else head_rows  # a GGUF head's blocks
    if head_rows is None or head_rows.data_ptr() != embed.data_ptr():  # a table the head does not read
        weights -= (embed.shape[0] - 1) * embed[0].numel() * embed.element_size()
    return weights + cell_bytes(cache, fill)


def read_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """The machine's read bandwidth with the current threads, in GB/s: the best of ``repeats`` STREAM-style
    reads of a ``mib`` MiB buffer (larger than the caches; :mod:`selfextend.native.stream`), or of
    ``torch.sum`` over it where the probe is not built."""
    probe = stream_probe()
    if probe is not None:
        return probe(mib, repeats)
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def cpu_model() -> str:
    """The CPU's model name, as ``lscpu`` prints it (Linux's /proc/cpuinfo), or the platform's processor
    string elsewhere: printed beside a speed, since machines here differ (AVX2 EPYC, AVX-512 Xeon)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def wait_for_quiet(limit: float, timeout: float) -> float:
    """Wait until the machine's CPU is busy at most ``limit`` (a share of all cores, over one second) or
    ``timeout`` seconds have passed; the last share seen. On a machine others run tests on, a timed run
    started while they hold a core measures them (llama.cpp's spinning threads slow down several-fold)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        busy = psutil.cpu_percent(interval=1.0) / 100
        if busy <= limit or time.monotonic() >= deadline:
            return busy


def _own_cpu_seconds() -> float:
    """CPU seconds this process and its children (those waited for) have used."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@contextmanager
def others_cpu(record: dict, pids: tuple[int, ...] = ()) -> Iterator[None]:
    """``record["others_cpu"]``: the share of the machine's CPU time that processes other than this one,
    the children it waited for and ``pids`` (running children, such as a server) took during the block (0.5
    on two cores: one core taken all along), to read a timing on a shared machine by."""
    import psutil

    def own() -> float:
        times = [psutil.Process(pid).cpu_times() for pid in pids]
        return _own_cpu_seconds() + sum(t.user + t.system for t in times)

    before, mine = psutil.cpu_times(), own()
    yield
    after, mine = psutil.cpu_times(), own() - mine
    total = sum(after) - sum(before)
    busy = total - (after.idle - before.idle) - (after.iowait - before.iowait)
    record["others_cpu"] = round(max(0.0, busy - mine) / total, 3) if total > 0 else None


@contextmanager
def bandwidth_around(record: dict) -> Iterator[None]:
    """``record["read_bandwidth_gbs"]``: [lowest, highest] of the read bandwidth just before and just after
    the block (GB/s): a shared host's memory moves with its other tenants, so one reading is not the
    bandwidth a timed run had."""
    before = read_bandwidth_gbs()
    yield
    after = read_bandwidth_gbs()
    record["read_bandwidth_gbs"] = [round(min(before, after), 2), round(max(before, after), 2)]


def generate_variants(weights: list[str]) -> list[str]:
    """The generate case's variants, in the order each round runs them: each weight form plain and with
    Self-Extend, then llama.cpp."""
    return [v for w in weights for v in (w, f"{w}+selfextend")] + ["llama.cpp"]


@torch.no_grad()
def bench_generate(
    models: dict[str, nn.Module], cfg: BenchConfig, gguf: str | Path | None = None, threads: int = 1
) -> Iterator[dict]:
    """Greedy tokens/s through a context-shift cache of ``endless_ctx`` cells: our loop with each of
    ``models`` (by weight form: float, int8, int4), plain and with Self-Extend, and llama.cpp on ``gguf``
    (the same model file) when llama-cpp-python is installed. Interleaved per repeat, the same prompt for
    all; every record has the weights it ran (a form, or ``gguf`` for llama.cpp), the bytes a step reads
    (MB/token) and the rate that makes (GB/s)."""
    from selfextend.bench import llamacpp

    ctx, keep = cfg.endless_ctx, cfg.endless_keep
    fill = average_fill(ctx, keep)
    first = next(iter(models.values()))
    llama = llamacpp.LlamaCppGenerator(gguf, ctx, keep, threads) if gguf and llamacpp.available() else None
    if llama is not None:  # its weights as the file stores them, its cells in f16 (llama.cpp's default)
        f16 = ContextShiftCache(first, n_ctx=ctx, dtype=torch.float16)
        llama_mb = (llamacpp.gguf_weight_bytes(gguf) + cell_bytes(f16, fill)) / 1e6
        del f16
    for rep in range(cfg.repeats):
        prompt = _tokens(first, ctx // 2, seed=rep).tolist()[0]
        for name in generate_variants(list(models)):
            form = "gguf" if name == "llama.cpp" else name.removesuffix("+selfextend")
            record = {"case": "generate", "variant": name, "length": ctx, "repeat": rep, "weights": form}
            if name == "llama.cpp":
                if llama is None:
                    continue
                before = llama.shifts
                with bandwidth_around(record):
                    record["tokens_per_s"] = llama.tokens_per_second(prompt, cfg.endless_tokens)
                record["shifts"] = llama.shifts - before
                record["mb_per_token"] = llama_mb
            else:
                lm = models[form]
                attention = "selfextend" if name.endswith("selfextend") else "plain"
                with variant(lm, attention, cfg.group_size, cfg.window):
                    gen = generator_for(lm, cfg, ctx)
                    logits = gen.feed(prompt)
                    _greedy_seconds(gen, logits, 2)  # the first steps compile (once per model) or warm up
                    with bandwidth_around(record):
                        seconds = _greedy_seconds(gen, gen.last_logits, cfg.endless_tokens)
                    record["tokens_per_s"] = cfg.endless_tokens / seconds
                    record["shifts"] = gen.cache.shifts
                    record["mb_per_token"] = bytes_per_token(lm, gen.cache, fill) / 1e6
            record["gb_per_s"] = record["mb_per_token"] * record["tokens_per_s"] / 1e3
            yield record


@torch.no_grad()
def bench_first_token(
    models: dict[str, nn.Module], cfg: BenchConfig, gguf: str | Path | None = None, threads: int = 1
) -> Iterator[dict]:
    """Seconds to the first token of a prompt of each of ``cfg.prefill_lengths`` tokens: ours (each of
    ``models`` by weight form, with Self-Extend, 512-token pieces) against llama.cpp on ``gguf``,
    interleaved per repeat."""
    from selfextend.bench import llamacpp

    first = next(iter(models.values()))
    for rep in range(cfg.repeats):
        for length in cfg.prefill_lengths:
            prompt = _tokens(first, length, seed=rep).tolist()[0]
            for name in [f"{w}+selfextend" for w in models] + ["llama.cpp"]:
                form = "gguf" if name == "llama.cpp" else name.removesuffix("+selfextend")
                record = {"case": "first-token", "variant": name, "length": length, "repeat": rep}
                record["weights"] = form
                if name == "llama.cpp":
                    if not gguf or not llamacpp.available():
                        continue
                    llama = llamacpp.LlamaCppGenerator(gguf, length + 1, cfg.endless_keep, threads)
                    record["seconds"] = llama.first_token_seconds(prompt)
                    del llama
                    yield record
                    continue
                lm = models[form]
                with variant(lm, "selfextend", cfg.group_size, cfg.window):
                    gen = generator_for(lm, cfg, length + 1)
                    _sync(gen.device)
                    t0 = time.perf_counter()
                    gen.next_token(gen.feed(prompt, min(512, gen.cache.max_chunk())))
                    _sync(gen.device)
                    record["seconds"] = time.perf_counter() - t0
                engines = {m.chunk_engine for m in lm.modules() if isinstance(m, BlockLinear)}
                if engines:  # GGUF block layers: how their prefill chunks multiplied
                    record["prefill_engine"] = ",".join(sorted(engines))
                yield record
