"""Passkey retrieval (the Self-Extend paper's synthetic task): find a 5-digit number hidden in filler.

A random passkey sits at a relative depth inside repeated filler text; the model is then
asked for it and answers greedily. Correct when the first number it writes is the passkey.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from selfextend.cache import ContextShiftCache
from selfextend.generate import Generator
from selfextend.methods import Method, applied, unique_methods
from selfextend.results import append_jsonl, done_keys, read_jsonl, repair_tail
from selfextend.sweep import check_lengths, dtype_name
from selfextend.validate import ValidationError, check_float, check_int, check_seed

TASK = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"
ANSWER_TOKENS = 8


def build_passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Token ids of about ``length`` tokens, ``key`` at relative ``depth`` of the filler (0 start, 1 end)."""

    def count(text: str) -> int:
        return len(tokenizer(text).input_ids)

    fixed = count(TASK + KEY.format(key=key) + QUESTION)
    per_filler = count(FILLER * 20) / 20
    n_filler = max(1, int((length - fixed) / per_filler))
    before = round(n_filler * depth)
    text = TASK + FILLER * before + KEY.format(key=key) + FILLER * (n_filler - before) + QUESTION
    return list(tokenizer(text).input_ids)


@torch.no_grad()
def answer(model: nn.Module, ids: list[int], method: Method) -> list[int]:
    """Greedy answer tokens after the prompt, under ``method`` (a shift method streams the prompt)."""
    with applied(model, method):
        if method.kind == "shift":
            cache = ContextShiftCache(model, int(method.params["ctx"]), int(method.params.get("keep", 0)))
            gen = Generator(model, cache)
            logits = gen.feed(ids)
        else:
            gen = Generator(model, ContextShiftCache(model, len(ids) + ANSWER_TOKENS + 1))
            logits = gen.feed(ids, chunk=len(ids))
        return list(gen.decode(logits, ANSWER_TOKENS))


RESUME_FIELDS = ("model", "dtype", "method", "length", "depth", "trial", "seed")
"""What makes two trials the same trial (the answer is greedy, so nothing else changes it)."""
LEGACY = {"dtype": "float32", "seed": 0}
"""Records written before ``dtype`` and ``seed`` were recorded: float32 and seed 0, the defaults then."""


def passkey_sweep(
    model: nn.Module,
    tokenizer,
    model_name: str,
    methods: list[Method],
    lengths: list[int],
    depths: list[float],
    trials: int,
    out: str | Path,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Iterator[dict]:
    """Every missing (method, length, depth, trial) point, one JSONL record each, appended as it finishes.

    Passkeys come from ``seed`` and the point's coordinates, so a resumed run asks the same questions.
    """
    methods, lengths = unique_methods(list(methods)), check_lengths(lengths)
    depths = sorted({check_float(d, "depth", 0.0, 1.0) for d in depths})
    if not depths:
        raise ValidationError("depths", "needs at least one depth in [0, 1]")
    trials, seed = check_int(trials, "trials", 1), check_seed(seed)
    if seed is None:
        raise ValidationError("seed", "must be an integer (the passkeys are drawn from it)")
    dtype = dtype_name(model)
    repair_tail(out)
    done = done_keys(read_jsonl(out), RESUME_FIELDS, LEGACY)
    for method in methods:
        for length in lengths:
            for depth in depths:
                for trial in range(trials):
                    if (model_name, dtype, method.name, length, depth, trial, seed) in done:
                        continue
                    key = random.Random(f"{seed}-{length}-{depth}-{trial}").randint(10000, 99999)
                    ids = build_passkey_prompt(tokenizer, length, depth, key)
                    t0 = time.perf_counter()
                    text = tokenizer.decode(answer(model, ids, method), skip_special_tokens=True)
                    found = re.search(r"\d+", text)
                    record = {
                        "model": model_name,
                        "dtype": dtype,
                        "seed": seed,
                        "method": method.name,
                        "length": length,
                        "depth": depth,
                        "trial": trial,
                        "passkey": key,
                        "answer": text.strip(),
                        "correct": bool(found and found.group(0) == str(key)),
                        "tokens": len(ids),
                        "seconds": round(time.perf_counter() - t0, 2),
                    }
                    append_jsonl(out, record)
                    if progress:
                        progress(length)
                    yield record
