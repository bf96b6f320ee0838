"""Speculative decoding: drafted tokens checked in one pass of the decode step, greedy output plain greedy
decoding's token for token, sampled output drawn from plain sampling's distribution.

A decode step reads every weight once however many rows it multiplies (on a memory-bound CPU, k + 1 rows
cost about one weight read), and the GGUF block products are batch-invariant: a row's result does not
depend on the rows beside it. So the logits of a drafted token checked among others are the very logits
plain decoding computes for it, and keeping the drafts greedy decoding agrees with (then its own next
token) gives exactly the plain output, each accepted draft one weight pass saved. The cells of drafts not
kept are truncated away; drafts fill only the cells left before the next context shift, so shifts come
where plain decoding's do.

Drafts come from the context itself (prompt lookup, transformers' ``prompt_lookup_num_tokens``, llama.cpp's
n-gram drafts: the tokens that followed the latest earlier occurrence of the last few tokens; no second
model, it pays where text repeats) or from a smaller model of the same vocabulary (a :class:`Drafter`,
:class:`~selfextend.generation.draft.DraftModel`).

Sampling keeps its distribution by the accept/reject rule of Leviathan et al. (2023) and Chen et al.
(2023): a draft ``x`` drawn from ``q`` is kept with probability ``min(1, p(x) / q(x))``, where ``p`` is the
distribution plain sampling draws from at that position (penalties, logit bias, response format, top-k,
top-p, min-p and temperature applied, :meth:`Generator.probabilities`); at the first draft refused, the
token is drawn from ``max(0, p - q)`` renormalized, and past the last draft from ``p``. A prompt-lookup
draft has ``q`` all on ``x``. The random stream, the generator's seeded CPU generator: a draft model's
draws, one uniform number per draft looked at, one draw per token from a residual or after the last draft
(through :func:`~selfextend.generation.sampling.sample`), so a seed repeats a run, but the tokens differ
from a plain run's with the same seed (the distribution is the same; a chi-square test holds it so).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from selfextend.generation.decode import DecodeStep
from selfextend.generation.sampling import SamplingParams
from selfextend.kv.cache import ContextShiftCache


class Drafter(Protocol):
    """Where drafts come from other than the context: ``propose(context, n, cache, sampling, rng)`` returns up
    to ``n`` tokens to follow ``context`` (the target's cached tokens, then its last token drawn), and their
    draft distributions (n, vocab) or None where each draft's ``q`` is all on it (greedy drafts); ``cache``
    is the target's (its shifts are mirrored), ``sampling`` its settings and ``rng`` its random stream.
    ``most``: the drafts asked for per pass. ``prepare(context, cache)``: the target has just read a prompt
    (``context``, its cached tokens): a drafter that reads the context itself reads it now."""

    most: int

    def prepare(self, context: Sequence[int], cache: ContextShiftCache, chunk: int | None = None) -> None: ...

    def propose(
        self,
        context: Sequence[int],
        n: int,
        cache: ContextShiftCache,
        sampling: SamplingParams,
        rng: torch.Generator,
    ) -> tuple[list[int], torch.Tensor | None]: ...


class Generator(Protocol):
    """What speculative decoding uses of a :class:`~selfextend.generation.generator.Generator` (which
    imports this module: a protocol, not an import back)."""

    tokens: list[int]
    cache: ContextShiftCache
    step: DecodeStep | None
    sampling: SamplingParams
    rng: torch.Generator
    draft: Drafter | None
    drafted: int  # tokens drafted and checked so far
    kept: int  # of them, those kept
    odds: DraftOdds  # how many drafts the next check is worth

    def next_token(self, logits: torch.Tensor) -> int: ...
    def probabilities(self, logits: torch.Tensor) -> torch.Tensor: ...
    def take(self, token: int) -> None: ...
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
    """Why ``gen`` cannot decode speculatively with plain decoding's exact tokens (greedy) or distribution
    (sampling), or None: it needs a direct decode step whose products are batch-invariant (every layer a
    GGUF block layer in one native call)."""
    if gen.step is None or not gen.step.supported() or gen.step.native_layers is None:
        return "no batch-invariant decode step (GGUF block weights, --weights gguf, on the CPU)"
    return None


def drafts_for(gen: Generator, token: int, n: int) -> tuple[list[int], torch.Tensor | None]:
    """Up to ``n`` drafts to follow ``gen``'s cached tokens and ``token`` (drawn, not written), from its
    :class:`Drafter` or else by prompt lookup, with their draft distributions (None: each all on its draft);
    none where ``n < 1``."""
    n = min(n, gen.step.most_rows() - 1)  # the rows the one-call step checks together
    if n < 1:
        return [], None
    context = [*gen.tokens, token]
    if gen.draft is not None:
        return gen.draft.propose(context, n, gen.cache, gen.sampling, gen.rng)
    return lookup_draft(context, n), None


def choose(gen: Generator, logits: torch.Tensor, draft: int | None, q: torch.Tensor | None) -> int:
    """The token after ``logits`` (vocab,) where ``draft`` was proposed from ``q`` (vocab,) (None: all on
    ``draft``): greedy, the plain next token (the draft kept where they agree); sampled, the draft kept with
    probability ``min(1, p(draft) / q(draft))``, else a draw from ``max(0, p - q)`` renormalized, so the
    token is distributed as plain sampling's. Without a draft, the plain next token."""
    if draft is None or gen.sampling.temperature == 0:
        return gen.next_token(logits)
    p = gen.probabilities(logits)  # (vocab,)
    if not bool(torch.isfinite(p).all()):
        raise ValueError("cannot sample: the model's probabilities are not numbers (its output is broken)")
    p_x, q_x = float(p[draft]), 1.0 if q is None else float(q[draft])
    if float(torch.rand((), generator=gen.rng)) * q_x < p_x:
        gen.take(draft)
        return draft
    if q is None:
        residual = p.clone()
        residual[draft] = 0
    else:
        residual = (p - q.to(p.dtype)).clamp_min_(0)
    if not float(residual.sum()) > 0:  # p and q equal but for rounding: nothing left to draw but the draft
        residual = torch.nn.functional.one_hot(torch.tensor(draft), p.numel()).to(p.dtype)
    token = int(torch.multinomial(residual, 1, generator=gen.rng))
    gen.take(token)
    return token


def speculative_decode(
    gen: Generator,
    logits: torch.Tensor,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    stop: Callable[[], bool] | None,
    most: int,
) -> Iterator[int]:
    """:meth:`Generator.decode`'s tokens and cache with up to ``most`` drafted tokens checked per pass: each
    yielded token is written when the next is asked for, an end token is yielded last and not written, and
    a consumer that stops early leaves its last token out of the cache, as there."""
    produced = 0

    def more() -> bool:
        return (max_new_tokens < 0 or produced < max_new_tokens) and not (stop is not None and stop())

    if not more():
        return
    token = gen.next_token(logits)
    produced += 1
    yield token
    while token not in eos_token_ids:
        if not more():  # as plain decoding: the last token written once the consumer asks past it
            gen.write([token])
            return
        k = gen.odds.worth(most)
        room = k if max_new_tokens < 0 else min(k, max_new_tokens - produced)
        # drafts only into the cells left before the next shift: shifts come where plain decoding's do
        drafts, q = drafts_for(gen, token, min(room, gen.cache.free() - 1))
        seq = [token, *drafts]
        gen.make_room(len(seq))
        base = gen.cache.n_past
        rows = gen.step.rows(seq, [gen.cache] * len(seq))  # (1 + k, vocab): after each of seq
        kept = 1  # cells of seq that stay: the token, then each draft the rule keeps
        took = 0  # drafts the rule kept (the last one's cell written next, if at all)
        try:
            while True:
                gen.written([seq[kept - 1]], rows[kept - 1])
                ahead = kept <= len(drafts)
                token = choose(gen, rows[kept - 1], drafts[kept - 1] if ahead else None, _row(q, kept - 1))
                took += ahead and token == drafts[kept - 1]
                produced += 1
                yield token
                if not ahead or token != drafts[kept - 1] or token in eos_token_ids or not more():
                    break
                kept += 1
        finally:  # the drafts' cells past what was kept (the last token yielded is written next, if at all)
            gen.drafted, gen.kept = gen.drafted + len(drafts), gen.kept + took
            gen.odds.seen(len(drafts), took)
            if base + kept < gen.cache.n_past:
                gen.rewind(base + kept)


ROW_COST = 0.2  # a drafted row's cost in lone-token steps (2-core Xeon: 1.6-2 ms a row of the 135M Q4_1 past
# 4 rows against a step of 8.7 ms; 12 ms of the 1.5B Q4_K_M's 60)
MEMORY = 0.75  # the weight of what earlier checks saw against the latest's in the odds a draft is kept


@dataclass
class DraftOdds:
    """How many drafts are worth checking next, from the drafts checks kept so far.

    ``kept`` and ``refused`` count the drafts kept and the first refusals, decayed by :data:`MEMORY` a check
    (so a text that stops repeating is seen soon); ``alpha = (kept + 1/2) / (kept + refused + 1)`` (a prior of
    one draft half kept) estimates the chance a draft is kept once the one before it was, so draft ``i`` is
    kept with chance ``alpha ** i``. It is worth its row while that exceeds what the row costs
    (:data:`ROW_COST` of a step) in the step's own tokens, one for each sequence checked beside it. Where
    not even one draft is worth it, none is asked for and the counts decay toward the prior, so drafting is
    tried again some checks later. Starts as after four drafts kept (alpha 0.9: up to 15 drafts at first)."""

    kept: float = 4.0
    refused: float = 0.0

    def seen(self, drafted: int, took: int) -> None:
        """A check of ``drafted`` drafts kept ``took`` (the rest refused from the first not kept on)."""
        self.kept = MEMORY * self.kept + took
        self.refused = MEMORY * self.refused + (took < drafted)

    def worth(self, most: int, sequences: int = 1) -> int:
        """The drafts worth asking for, at most ``most``, in a step over ``sequences`` sequences."""
        alpha, bar = (self.kept + 0.5) / (self.kept + self.refused + 1.0), ROW_COST * sequences
        if alpha <= bar or most < 1:
            return 0
        return min(most, max(1, int(math.log(bar) / math.log(alpha))))


def _row(q: torch.Tensor | None, i: int) -> torch.Tensor | None:
    """Draft ``i``'s distribution, or None where every draft's is all on it."""
    return None if q is None or i >= len(q) else q[i]


def draft_and_check(pairs: Sequence[tuple[Generator, int, int]]) -> list[tuple[list[int], int]]:
    """Several sequences' next tokens in one pass of their shared decode step (a server's slots): for each
    ``(generator, its last token, drawn but not written; a draft budget)``, the token and up to ``budget``
    drafts written and checked (fewer where its checks kept few: :class:`DraftOdds`), the drafts
    the rule keeps kept (the rest truncated). Returns per generator
    ``(its tokens in order: the kept drafts, then the next token, drawn and not written; the cache position
    where the token went)``. Each generator must pass :func:`speculates`."""
    seqs, qs, bases = [], [], []
    for gen, token, budget in pairs:
        drafts, q = drafts_for(gen, token, min(gen.odds.worth(budget, len(pairs)), gen.cache.free() - 1))
        seqs.append([token, *drafts])
        qs.append(q)
        gen.make_room(len(seqs[-1]))  # a shift only where one token would not fit: plain decoding's
        bases.append(gen.cache.n_past)
    caches = [gen.cache for (gen, _, _), seq in zip(pairs, seqs, strict=True) for _ in seq]
    rows = pairs[0][0].step.rows([t for seq in seqs for t in seq], caches)  # (sum of 1 + k, vocab)
    out, at = [], 0
    for (gen, _, _), seq, q, base in zip(pairs, seqs, qs, bases, strict=True):
        kept, tokens = 1, []
        while True:
            gen.written([seq[kept - 1]], rows[at + kept - 1])
            draft = seq[kept] if kept < len(seq) else None
            tokens.append(choose(gen, rows[at + kept - 1], draft, _row(q, kept - 1)))
            if draft is None or tokens[-1] != draft:
                break
            kept += 1
        gen.drafted, gen.kept = gen.drafted + len(seq) - 1, gen.kept + kept - 1
        gen.odds.seen(len(seq) - 1, kept - 1)
        if base + kept < gen.cache.n_past:
            gen.rewind(base + kept)
        out.append((tokens, base))
        at += len(seq)
    return out
