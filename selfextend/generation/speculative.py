"""Speculative greedy decoding by prompt lookup: drafted tokens checked in one pass of the decode step, the
output plain greedy decoding's token for token.

A decode step reads every weight once however many rows it multiplies (on a memory-bound CPU, k + 1 rows
cost about one weight read), and the GGUF block products are batch-invariant: a row's result does not
depend on the rows beside it. So the logits of a drafted token checked among others are the very logits
plain decoding computes for it, and keeping the drafts greedy decoding agrees with (then its own next
token) gives exactly the plain output, each accepted draft one weight pass saved. The cells of drafts not
kept are truncated away; drafts fill only the cells left before the next context shift, so shifts come
where plain decoding's do.

Drafts come from the context itself (prompt lookup, transformers' ``prompt_lookup_num_tokens``, llama.cpp's
n-gram drafts): the tokens that followed the latest earlier occurrence of the last few tokens. No second
model; it pays where text repeats (code edits, copies, summaries quoting their source).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from selfextend.generation.decode import DecodeStep
from selfextend.generation.sampling import SamplingParams
from selfextend.kv.cache import ContextShiftCache


class Generator(Protocol):
    """What speculative decoding uses of a :class:`~selfextend.generation.generator.Generator` (which
    imports this module: a protocol, not an import back)."""

    tokens: list[int]
    cache: ContextShiftCache
    step: DecodeStep | None
    sampling: SamplingParams
    grammar: object | None

    def next_token(self, logits: torch.Tensor) -> int: ...
    def make_room(self, n: int) -> None: ...
    def written(self, ids: list[int], logits: torch.Tensor) -> None: ...
    def rewind(self, n_past: int) -> None: ...


NGRAM = 3  # the longest tail looked up (then shorter ones), as transformers' default max_matching_ngram_size
SEARCH = 4096  # tokens searched back from the end (the lookup is Python: bounded per token)


def lookup_draft(tokens: Sequence[int], n: int, ngram: int = NGRAM) -> list[int]:
    """Up to ``n`` tokens that followed the latest earlier occurrence of the last ``m`` tokens of ``tokens``,
    for the longest ``m`` of ``ngram`` down to 1 that occurs; [] where none does."""
    if n < 1 or len(tokens) < 2:
        return []
    seen = list(tokens[-SEARCH:])
    for m in range(min(ngram, len(seen) - 1), 0, -1):
        tail = seen[-m:]
        for start in range(len(seen) - m - 1, -1, -1):
            if seen[start : start + m] == tail:
                return seen[start + m : start + m + n]
    return []


def speculates(gen: Generator) -> str | None:
    """Why ``gen`` cannot decode speculatively with plain greedy decoding's exact output, or None: it needs
    greedy settings without a response format, and a direct decode step whose products are batch-invariant
    (every layer a GGUF block layer in one native call)."""
    if gen.sampling.temperature != 0:
        return "sampling (speculative decoding here is greedy)"
    if gen.grammar is not None:
        return "a response format"
    if gen.step is None or not gen.step.supported() or gen.step.native_layers is None:
        return "no batch-invariant decode step (GGUF block weights, --weights gguf, on the CPU)"
    return None


def speculative_decode(
    gen: Generator,
    logits: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    stop: Callable[[], bool] | None,
    lookup: int,
) -> Iterator[int]:
    """:meth:`Generator.decode`'s tokens and cache, greedy, with up to ``lookup`` drafted tokens checked per
    pass: each yielded token is written when the next is asked for, an end token is yielded last and not
    written, and a consumer that stops early leaves its last token out of the cache, as there."""
    produced = 0

    def more() -> bool:
        return (max_new_tokens < 0 or produced < max_new_tokens) and not (stop is not None and stop())

    if not more():
        return
    token = gen.next_token(logits)
    produced += 1
    yield token
    k = lookup  # drafts asked for: halved after a check that kept none, doubled after one that kept all
    while token not in eos_token_ids:
        if not more():  # as plain decoding: the last token written once the consumer asks past it
            gen.write([token])
            return
        room = k if max_new_tokens < 0 else min(k, max_new_tokens - produced)
        # drafts only into the cells left before the next shift: shifts come where plain decoding's do
        drafts = lookup_draft([*gen.tokens, token], min(room, gen.cache.free() - 1))
        seq = [token, *drafts]
        gen.make_room(len(seq))
        base = gen.cache.n_past
        rows = gen.step.rows(seq, [gen.cache] * len(seq))  # (1 + k, vocab): after each of seq
        kept = 1  # cells of seq that stay: the token, then each draft greedy decoding also picks
        try:
            while True:
                gen.written([seq[kept - 1]], rows[kept - 1])
                token = gen.next_token(rows[kept - 1])
                produced += 1
                yield token
                if kept > len(drafts) or token != drafts[kept - 1] or token in eos_token_ids or not more():
                    break
                kept += 1
        finally:  # the drafts' cells past what was kept (the last token yielded is written next, if at all)
            if base + kept < gen.cache.n_past:
                gen.rewind(base + kept)
        if drafts:  # a check costs its rows' attention and activations: fewer drafts where few are kept
            k = max(1, k // 2) if kept == 1 else min(lookup, 2 * k) if kept > len(drafts) else k


def draft_and_check(pairs: Sequence[tuple[Generator, int, int]]) -> list[tuple[list[int], int]]:
    """Several sequences' next tokens in one pass of their shared decode step (a server's slots): for each
    ``(generator, its last token, drawn but not written; a draft budget)``, the token and up to ``budget``
    drafts written and checked, the drafts greedy decoding agrees with kept (the rest truncated). Returns per
    generator ``(its greedy tokens in order: the kept drafts, then the next token, drawn and not written;
    the cache position where the token went)``. Each generator must pass :func:`speculates`."""
    seqs, bases = [], []
    for gen, token, budget in pairs:
        drafts = lookup_draft([*gen.tokens, token], min(budget, gen.cache.free() - 1))
        seqs.append([token, *drafts])
        gen.make_room(len(seqs[-1]))  # a shift only where one token would not fit: plain decoding's
        bases.append(gen.cache.n_past)
    caches = [gen.cache for (gen, _, _), seq in zip(pairs, seqs, strict=True) for _ in seq]
    rows = pairs[0][0].step.rows([t for seq in seqs for t in seq], caches)  # (sum of 1 + k, vocab)
    out, at = [], 0
    for (gen, _, _), seq, base in zip(pairs, seqs, bases, strict=True):
        kept, tokens = 1, []
        while True:
            gen.written([seq[kept - 1]], rows[at + kept - 1])
            tokens.append(gen.next_token(rows[at + kept - 1]))
            if kept == len(seq) or tokens[-1] != seq[kept]:
                break
            kept += 1
        if base + kept < gen.cache.n_past:
            gen.rewind(base + kept)
        out.append((tokens, base))
        at += len(seq)
    return out
