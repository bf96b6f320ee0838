"""check.py's 8b section: a Llama-3.1-8B shape with random bf16 weights on the GPU (built in seconds; no file
is read): prefill plain against Self-Extend (G=32, W=2048) with peak memory, and decode ms/token through
our engine (the generator's step over context-shift cells: bench_decode); then the engine's paths with this
shape against a CPU copy (:mod:`gpu_8b_runs`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from gpu_8b_runs import runs
from transformers import LlamaConfig, LlamaForCausalLM

import selfextend.generation.layer as layer_module
from selfextend.bench.runner import (
    BenchConfig,
    MemoryMeter,
    bench_decode,
    bench_prefill,
)
from selfextend.generation.graphed import cuda_graph

G, W = 32, 2048
SHAPE = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
DECODE_TOKENS = 32
HBM_GBS = 4800  # an H200's HBM3e read rate, the decode limit's denominator


# small enough to run on the CPU; the chat's tokenizer has 49,152 ids
DRY = dict(SHAPE, vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2)
DRY_SCALE = 64  # --dry-run: lengths and G, W divided by this


def build(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(
                LlamaConfig(**(SHAPE if device == "cuda" else DRY), attn_implementation="sdpa")
            )
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def eight_b(
    report: Callable[..., None],
    gpu: str,
    long: bool,
    device: str = "cuda",
    guarded: Callable = None,
    speed: bool = True,
    cpu_copy: bool = True,
) -> None:
    """Prefill, decode and two slots (``speed``), then the engine's paths against a CPU copy (``cpu_copy``),
    each through ``guarded`` (check.py's: one that raises is reported and the next runs)."""
    guarded = guarded or (lambda _name, check, *args: check(*args))
    model = build(device)
    k = 1 if device == "cuda" else DRY_SCALE
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    report("8b model", gpu=gpu, weights_gb=round(weight_bytes / 1e9, 2))
    if speed:
        guarded("8b prefill", prefill, report, model, gpu, long, k)
        guarded("8b engine decode", decode, report, model, gpu, k, weight_bytes)
    runs(report, model, gpu, group=4, window=16, guarded=guarded, slots=speed, cpu_copy=cpu_copy)


def prefill(report: Callable[..., None], model: torch.nn.Module, gpu: str, long: bool, k: int) -> None:
    """Prefill plain against Self-Extend at 16k-64k (128k: ``long``), lengths divided by ``k`` in a dry
    run (whose shape is not judged)."""
    device = next(model.parameters()).device
    g, w = G // min(k, 8), W // k
    lengths = [n // k for n in [16384, 32768, 65536] + ([131072] if long else [])]
    cfg = BenchConfig(lengths, [8192 // k], group_size=g, window=w, repeats=2, reference_max=0)
    rows = list(bench_prefill(model, cfg, MemoryMeter(device)))
    for length in lengths:
        at = [r for r in rows if r["length"] == length]
        by = {v: [r for r in at if r["variant"] == v] for v in ("plain", "selfextend")}
        ratios = [s["seconds"] / p["seconds"] for p, s in zip(by["plain"], by["selfextend"], strict=True)]
        peak = max(r["peak_mib"] for r in by["selfextend"]) / max(r["peak_mib"] for r in by["plain"])
        report(
            f"8b prefill {length * k // 1024}k",
            ok=(max(ratios) <= 1.10 and peak <= 1.05) if k == 1 else None,
            plain_s=[round(r["seconds"], 3) for r in by["plain"]],
            selfextend_s=[round(r["seconds"], 3) for r in by["selfextend"]],
            ratio_per_round=[round(x, 2) for x in ratios],
            peak_ratio=round(peak, 3),
            gpu=gpu,
        )


def decode(report: Callable[..., None], model: torch.nn.Module, gpu: str, k: int, weight_bytes: int) -> None:
    """Our engine's decode ms/token at 8k and 32k cells (divided by ``k`` in a dry run), plain and
    Self-Extend, against the weights' read at the HBM's rate."""
    g, w = G // min(k, 8), W // k
    limit_ms = weight_bytes / (HBM_GBS * 1e9) * 1e3
    cells = [8192 // k, 32768 // k]
    cfg = BenchConfig([16384 // k], cells, group_size=g, window=w, repeats=2, decode_steps=DECODE_TOKENS)
    cfg.cache_type = "bf16"
    rows = list(bench_decode(model, cfg))
    for n in cells:
        ms = {
            v: statistics.median(r["ms_per_token"] for r in rows if r["length"] == n and r["variant"] == v)
            for v in ("plain", "selfextend")
        }
        se, plain = ms["selfextend"], ms["plain"]
        report(
            f"8b engine decode {n * k // 1024}k cells",
            ok=(se <= 7.0 and se / plain <= 1.1) if k == 1 and n * k == 32768 else None,
            plain_ms=round(plain, 2),
            selfextend_ms=round(se, 2),
            ratio=round(se / plain, 3),
            limit_ms=round(limit_ms, 2),
            gpu=gpu,
        )
    # the same at 32k cells with the step's elementwise work in torch's operations (the fused step kernels
    # off): what the fused kernels save a token, against what a small kernel costs in a graph here
    applies = layer_module.fused_step_applies
    layer_module.fused_step_applies = lambda x: False
    try:
        cfg.decode_lengths = cells[1:]
        rows = list(bench_decode(model, cfg))
    finally:
        layer_module.fused_step_applies = applies
    torch_ops = {
        v: statistics.median(r["ms_per_token"] for r in rows if r["variant"] == v)
        for v in ("plain", "selfextend")
    }
    report(
        f"8b engine decode {cells[1] * k // 1024}k cells, step in torch ops",
        plain_ms=round(torch_ops["plain"], 2),
        selfextend_ms=round(torch_ops["selfextend"], 2),
        small_kernel_us=round(graph_launch_us(next(model.parameters()).device), 2),
        gpu=gpu,
    )


def graph_launch_us(device: torch.device, n: int = 1000) -> float:
    """Microseconds a small kernel takes inside a CUDA graph here: ``n`` in-place adds on 4 KiB captured
    and replayed, the best of 5 (eagerly off a GPU): times the step's kernel count, what its launches
    cost a token (experiments/gpu/step_launches.py counts them)."""
    x = torch.zeros(1024, device=device)

    def adds() -> None:
        for _ in range(n):
            x.add_(1.0)

    run = cuda_graph(adds)[0].replay if device.type == "cuda" else adds
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        start = time.perf_counter()
        run()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        best = min(best, time.perf_counter() - start)
    return best / n * 1e6
