"""``selfextend bench --cases speculative``: speculative decoding against plain greedy decoding on a prompt
whose reply repeats it (the case drafts are for), rounds interleaved with the order flipped.

Each record: tokens/s, the drafts checked and kept, the acceptance rate, the tokens each pass of the decode
step wrote (one weight pass: 1 + the drafts kept), the ratio to plain in the same round, and whether the
tokens are plain's (they must be: the block products are batch-invariant). llama.cpp's own speculative
decoding is timed against ours by ``experiments/speed/spec_vs_llamacpp.py`` (llama-server with its n-gram and
draft-model settings on the same file).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from torch import nn

from selfextend.bench.runner import BenchConfig, generator_for
from selfextend.evaluation.corpus import default_books
from selfextend.generation.speculative import Drafter
from selfextend.generation.text import build_prompt


def copy_prompt(tokenizer) -> list[int]:
    """A paragraph of the default corpus to repeat word for word, chat-templated where the model has a
    template (the wording the default model copies: "Repeat this text exactly, word for word")."""
    paragraphs = [" ".join(p.split()) for p in default_books()["sherlock-holmes"].split("\n\n")]
    paragraph = next(p for p in paragraphs if 400 <= len(p) <= 700)
    return build_prompt(tokenizer, f"Repeat this text exactly, word for word:\n\n{paragraph}", chat=True)[0]


@torch.no_grad()
def bench_speculative(
    model: nn.Module, tokenizer, cfg: BenchConfig, lookup: int, draft: Drafter | None
) -> Iterator[dict]:
    """Per repeat, greedy decoding of ``cfg.endless_tokens`` tokens after :func:`copy_prompt`: plain, with
    ``lookup`` drafts by prompt lookup (0: not run) and with ``draft`` (None: not run), in an order flipped
    every repeat."""
    prompt = copy_prompt(tokenizer)
    n_ctx = max(cfg.endless_ctx, len(prompt) + cfg.endless_tokens + 1)
    variants = ["plain"] + [f"lookup {lookup}"] * (lookup > 0) + ["draft model"] * (draft is not None)
    for rep in range(cfg.repeats):
        rows = []
        for name in variants if rep % 2 == 0 else variants[::-1]:
            gen = generator_for(model, cfg, n_ctx)
            gen.lookup = lookup if name.startswith("lookup") else 0
            gen.draft = draft if name == "draft model" else None
            logits = gen.feed(prompt)
            t0 = time.perf_counter()
            tokens = list(gen.decode(logits, cfg.endless_tokens))  # each token drawn as an int: in step
            seconds = time.perf_counter() - t0
            record = {"case": "speculative", "variant": name, "length": len(prompt), "repeat": rep}
            record.update(tokens_per_s=len(tokens) / seconds, drafted=gen.drafted, kept=gen.kept)
            record["acceptance"] = gen.kept / gen.drafted if gen.drafted else 0.0
            record["tokens_per_pass"] = len(tokens) / max(1, len(tokens) - gen.kept)
            record["tokens"] = tokens
            rows.append(record)
        plain = next(r for r in rows if r["variant"] == "plain")
        plain_rate, plain_tokens = plain["tokens_per_s"], plain["tokens"]
        for record in rows:
            record["ratio"] = record["tokens_per_s"] / plain_rate
            record["identical"] = record.pop("tokens") == plain_tokens
        yield from rows
