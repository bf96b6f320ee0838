"""Passkey retrieval (the Self-Extend paper's synthetic task): find a 5-digit number hidden in filler.

A random passkey sits at a relative depth inside repeated filler text; the model is then
asked for it and answers greedily. Correct when the first number it writes is the passkey.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from selfextend.core.validate import MAX_SEED, ValidationError, check_float, check_int
from selfextend.evaluation.lengths import check_lengths
from selfextend.evaluation.methods import Method, applied, unique_methods
from selfextend.evaluation.nll import dense_sliding_mask
from selfextend.evaluation.results import FIRST_PROMPT, append_jsonl, own_records, repair_tail
from selfextend.evaluation.sweep import SCORING_CHUNK, dtype_name
from selfextend.generation.generator import Generator
from selfextend.kv.cache import ContextShiftCache

TASK = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
ANSWER_TOKENS = 8
PROMPT = 2
"""The prompt's form, in every record (a point of another form is measured again; ``table`` and ``plot``
count one form): 2, the task, the filler before the key, the key, the filler after it and the question on
lines of their own, as the Self-Extend and Landmark Attention code joins them. Form 1 ran them together, so
at depth 1 the key sentence ran into the question and SmolLM2 echoed "the pass key" in every trial; form 2
finds the key there (tests/test_measure.py)."""


def build_passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Token ids of about ``length`` tokens, ``key`` at relative ``depth`` of the filler (0 start, 1 end), in
    the form :data:`PROMPT` says. :class:`~selfextend.core.validate.ValidationError` where ``length`` cannot
    hold the task, one filler sentence, the key and the question (its record would name a length its
    prompt is not)."""

    depth = check_float(depth, "passkey depth", 0.0, 1.0)  # 2.0 made a prompt twice the length asked for

    def count(text: str) -> int:
        return len(tokenizer(text).input_ids)

    fixed = count("\n".join((TASK, "", KEY.format(key=key), "", QUESTION)))
    per_filler = count(" ".join([FILLER] * 20)) / 20
    if length < fixed + per_filler:
        least = math.ceil(fixed + per_filler)
        raise ValidationError("lengths", f"must be at least {least} for a passkey prompt here, got {length}")
    n_filler = max(1, int((length - fixed) / per_filler))
    before = round(n_filler * depth)
    lines = (TASK, " ".join([FILLER] * before), KEY.format(key=key), " ".join([FILLER] * (n_filler - before)))
    return list(tokenizer("\n".join((*lines, QUESTION))).input_ids)


def is_correct(text: str, key: int) -> bool:
    """Whether an answer's first number is the passkey (what every passkey record's ``correct`` says)."""
    found = re.search(r"\d+", text)
    return bool(found and found.group(0) == str(key))


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
            logits = gen.feed(ids, chunk=SCORING_CHUNK if dense_sliding_mask(model) else len(ids))
        return list(gen.decode(logits, ANSWER_TOKENS))


LEGACY = {"dtype": "float32", "seed": 0, "prompt": FIRST_PROMPT}
"""Records written before ``dtype``, ``seed`` and ``prompt`` were recorded: float32, seed 0 and the first
prompt form, the defaults then."""
KEY_FIELDS = ("model", "dtype", "seed", "prompt", "method", "length", "depth", "trial")


def point_key(record: dict) -> tuple:
    """What identifies a passkey point: a resumed or merged sweep holds each key once.

    Everything that changes the answer (it is greedy): model and weights, dtype, seed (the passkey), the
    prompt's form, method, length, depth, trial. A record missing a field gets None there and matches no
    real point.
    """
    return tuple(record.get(f, LEGACY.get(f)) for f in KEY_FIELDS)


@dataclass(frozen=True)
class Point:
    """One question: ``trial`` at ``depth`` in a prompt of about ``length`` tokens, under ``method``."""

    method: Method
    length: int
    depth: float
    trial: int


def passkey_plan(
    model_name: str,
    methods: list[Method],
    lengths: list[int],
    depths: list[float],
    trials: int,
    out: str | Path,
    dtype: str = "float32",
    seed: int = 0,
) -> list[Point]:
    """Every (method, length, depth, trial) point not yet in ``out`` for this model, ``dtype`` and ``seed``.

    Every argument is checked first (:class:`~selfextend.core.validate.ValidationError`, or MethodError for a
    method given twice).
    """
    methods, lengths = unique_methods(list(methods)), check_lengths(lengths)
    depths = sorted({check_float(d, "depth", 0.0, 1.0) for d in depths})
    if not depths:
        raise ValidationError("depths", "needs at least one depth in [0, 1]")
    trials, seed = check_int(trials, "trials", 1), check_int(seed, "seed", 0, MAX_SEED)
    done = {point_key(r) for r in own_records(out, "passkey")}
    return [
        Point(method, length, depth, trial)
        for method in methods
        for length in lengths
        for depth in depths
        for trial in range(trials)
        if (model_name, dtype, seed, PROMPT, method.name, length, depth, trial) not in done
    ]


def passkey_sweep(
    model: nn.Module,
    tokenizer,
    model_name: str,
    points: list[Point],
    out: str | Path,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Iterator[dict]:
    """Ask each of ``points``, appending one JSONL record to ``out`` as each finishes.

    Passkeys come from ``seed`` and the point's coordinates, so a resumed run asks the same questions.
    """
    seed, dtype = check_int(seed, "seed", 0, MAX_SEED), dtype_name(model)
    repair_tail(out)
    for p in points:
        key = random.Random(f"{seed}-{p.length}-{p.depth}-{p.trial}").randint(10000, 99999)
        ids = build_passkey_prompt(tokenizer, p.length, p.depth, key)
        t0 = time.perf_counter()
        text = tokenizer.decode(answer(model, ids, p.method), skip_special_tokens=True)
        record = {
            "model": model_name,
            "dtype": dtype,
            "seed": seed,
            "prompt": PROMPT,
            "method": p.method.name,
            "length": p.length,
            "depth": p.depth,
            "trial": p.trial,
            "passkey": key,
            "answer": text.strip(),
            "correct": is_correct(text, key),
            "tokens": len(ids),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        append_jsonl(out, record)
        if progress:
            progress(p.length)
        yield record
