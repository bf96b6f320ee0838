"""check.py's parity section: the engine's paths on ``cuda`` against the CPU, tiny float32 models (the test
suite's), greedy tokens identical."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from conftest import make_model, tiny_gemma3

from selfextend.evaluation.methods import applied, parse_method
from selfextend.evaluation.nll import token_nll
from selfextend.evaluation.passkey import answer
from selfextend.generation.backends import decode_backends
from selfextend.generation.batched import BatchedDecode
from selfextend.generation.generator import Generator, run
from selfextend.generation.graphed import GraphedDecode
from selfextend.generation.sampling import SamplingParams
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache
from selfextend.server.slots import Slot

PROMPT = list(range(3, 40))
CTX, KEEP, TOKENS = 48, 4, 60  # two shifts or more


def _model(family: str) -> torch.nn.Module:
    if family == "gemma3":
        return tiny_gemma3(["sliding_attention", "full_attention"], 8)
    return make_model(family)


def _generate(model: torch.nn.Module, sampling: SamplingParams, seed: int | None) -> tuple[list[int], int]:
    cache = ContextShiftCache(model, CTX, n_keep=KEEP, dtype=torch.float32)
    gen = Generator(model, cache, sampling, seed=seed)
    return [t for t, _ in run(gen, PROMPT, TOKENS)], cache.shifts


def _cells(model: torch.nn.Module) -> ContextShiftCache:
    return ContextShiftCache(model, 40, n_keep=4, dtype=torch.float32)


def parity(report: Callable[..., None], device: str = "cuda") -> None:
    for family in ("llama", "qwen3", "gemma3"):
        for se in (False, True):
            cpu = _model(family)
            if se:
                apply_self_extend(cpu, group_size=4, window=16)
            gpu = copy.deepcopy(cpu).to(device)
            name = f"parity generate {family}{' self-extend' if se else ''}"
            for label, sampling, seed in (
                ("greedy", SamplingParams(temperature=0), None),
                ("seeded", SamplingParams(temperature=0.8, top_k=40), 7),
            ):
                a, shifts = _generate(cpu, sampling, seed)
                b, _ = _generate(gpu, sampling, seed)
                same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                # a seeded draw may part where the two devices' logits round apart: said, not failed
                report(
                    f"{name} {label}",
                    ok=(same is None) if label == "greedy" else None,
                    tokens=len(a),
                    shifts=shifts,
                    first_difference=same,
                )
    model = make_model("llama")
    apply_self_extend(model, group_size=4, window=16)
    model.to(device)
    steps = decode_backends(model)  # as the server's engine shares them between its slots
    for shared_from, server in ((1, False), (8, False), (None, True)):
        batched = BatchedDecode(model, shared_from=shared_from)
        if server:
            gens = [Slot(i, model, 40, steps).generator(4) for i in range(2)]
        else:
            gens = [Generator(model, _cells(model)) for _ in range(2)]
        alone = [Generator(model, _cells(model)) for _ in range(2)]
        out, want = [[], []], [[], []]
        logits = [g.feed(PROMPT[:n]) for g, n in zip(gens, (30, 25), strict=True)]
        solo = [g.feed(PROMPT[:n]) for g, n in zip(alone, (30, 25), strict=True)]
        for _ in range(24):
            tokens = [int(x.argmax()) for x in logits]
            logits = batched(list(zip(gens, tokens, strict=True)))
            for j in range(2):
                out[j].append(tokens[j])
                t = int(solo[j].argmax())
                want[j].append(t)
                solo[j] = alone[j].write([t])
        graphed = all(isinstance(g.fast, GraphedDecode) for g in gens)  # a GPU's slots replay one graph
        report(
            "parity two server slots" if server else f"parity two slots (shared_from={shared_from})",
            ok=out == want and (graphed or device != "cuda"),
            graphed=graphed,
            shifts=[g.cache.shifts for g in gens],
        )
    cpu = make_model("llama")
    gpu = copy.deepcopy(cpu).to(device)
    ids = torch.tensor([PROMPT])
    for spec in ("plain", "selfextend:G=4,W=16", "ntk:factor=2"):
        diffs = []
        for chunk in (None, 16):
            with applied(cpu, parse_method(spec)), applied(gpu, parse_method(spec)):
                a = token_nll(cpu, ids, prefill_chunk=chunk)
                b = token_nll(gpu, ids, prefill_chunk=chunk)
            diffs.append(float((a - b).abs().max()))
        report(f"parity ppl {spec}", ok=max(diffs) < 1e-4, max_abs_nll_difference=f"{max(diffs):.1e}")
    for spec in ("selfextend:G=4,W=16", "shift:ctx=24,keep=4"):
        a, b = answer(cpu, PROMPT, parse_method(spec)), answer(gpu, PROMPT, parse_method(spec))
        report(f"parity passkey answer {spec}", ok=a == b, tokens=len(a))
