"""Speculative sampling keeps plain sampling's distribution (generation/speculative.py's accept/reject rule):
over many seeds, the first three tokens sampled with drafts (prompt lookup; a draft model of the same
vocabulary) follow the distribution computed exactly from the target's own probabilities (a chi-square
test), and a rule that keeps every draft fails the same test."""

from __future__ import annotations

import pytest
import torch
from test_models import write_tiny_gguf

import selfextend.generation.speculative as speculative
from selfextend.generation.draft import DraftModel
from selfextend.generation.generator import Generator
from selfextend.generation.sampling import SamplingParams
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model
from selfextend.native.quant import quant_kernels

pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernels")
CYCLE = [5, 9, 11, 13]  # the tokens the bias favours; the prompt repeats them, so lookup drafts them
PROMPT = CYCLE * 6
SAMPLING = dict(temperature=1.0, top_k=4, logit_bias={t: 4.0 for t in CYCLE})  # 4 tokens left, ~1/4 each
TOKENS, RUNS = 3, 600  # 9.4 draws expected of each of 64 outcomes; at 600 the rules kept p 0.21-0.99, the
# rule that keeps every draft p 0.0 (1,200 runs took half a minute more of the suite, which is at its budget)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Q8_0 target and a smaller draft of the same vocabulary, both GGUF blocks."""
    root = tmp_path_factory.mktemp("specsample")
    target = write_tiny_gguf(root / "target.gguf", hidden=256, heads=4, kv_heads=2, quant="Q8_0")
    draft = write_tiny_gguf(root / "draft.gguf", layers=1, hidden=64, heads=2, kv_heads=1, quant="Q8_0")
    return load_model(str(target), weights="gguf")[0], load_model(str(draft), weights="gguf")[0]


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """The draft with 8 ids more at the end of its table (270 against 262: padding, as llama.cpp allows)."""
    path = tmp_path_factory.mktemp("specpadded") / "padded.gguf"
    write_tiny_gguf(path, layers=1, hidden=64, heads=2, kv_heads=1, quant="Q8_0", extra_tokens=8)
    return load_model(str(path), weights="gguf")[0]


def _generator(model: torch.nn.Module, **kw) -> tuple[Generator, torch.Tensor]:
    gen = Generator(model, ContextShiftCache(model, 64), SamplingParams(**SAMPLING), seed=0, **kw)
    return gen, gen.feed(PROMPT)


def exact(model: torch.nn.Module) -> dict[tuple[int, ...], float]:
    """P(first TOKENS tokens) from the target's probabilities after each prefix (the step's own logits)."""
    gen, logits = _generator(model)
    probs: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], logits: torch.Tensor, mass: float) -> None:
        p = gen.probabilities(logits)
        assert float(p[CYCLE].sum()) == pytest.approx(1.0)  # the support is the cycle
        for t in CYCLE:
            if len(prefix) + 1 == TOKENS:
                probs[(*prefix, t)] = mass * float(p[t])
                continue
            gen.rewind(len(PROMPT) + len(prefix))
            walk((*prefix, t), gen.write([t]), mass * float(p[t]))

    walk((), logits, 1.0)
    return probs


def sampled(gen: Generator, logits: torch.Tensor) -> dict[tuple[int, ...], int]:
    """Counts of the first TOKENS tokens over RUNS seeds (the cache rewound to the prompt each time)."""
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(RUNS):
        gen.rewind(len(PROMPT))
        gen.rng.manual_seed(seed)
        out = tuple(gen.decode(logits, TOKENS))
        counts[out] = counts.get(out, 0) + 1
    return counts


def p_value(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs`` (outcomes expected fewer than 5 times
    pooled into one cell)."""
    assert set(counts) <= set(probs)
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for outcome, p in probs.items():
        expected = p * RUNS
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(outcome, 0), pooled_exp + expected
        else:
            cells.append((counts.get(outcome, 0), expected))
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    return float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2), torch.tensor(chi2 / 2)))


@pytest.fixture(scope="module")
def truth(models) -> dict[tuple[int, ...], float]:
    probs = exact(models[0])
    assert sum(probs.values()) == pytest.approx(1.0) and len(probs) == len(CYCLE) ** TOKENS
    return probs


def _watched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(draft, token) of every draft the rule looked at."""
    seen, real = [], speculative.choose

    def choose(gen, logits, draft, q):
        token = real(gen, logits, draft, q)
        if draft is not None:
            seen.append((draft, token))
        return token

    monkeypatch.setattr(speculative, "choose", choose)
    return seen


def test_plain_sampling_follows_the_exact_distribution(models, truth) -> None:
    """The yardstick itself: plain sampling passes the test it sets."""
    assert p_value(sampled(*_generator(models[0])), truth) > 1e-3


@pytest.mark.parametrize("source", ["lookup", "draft model", "partial draft vocabulary", "padded draft"])
def test_speculative_sampling_keeps_the_distribution(models, padded, truth, monkeypatch, source: str) -> None:
    """Also where the draft's distribution leaves out tokens the target draws: a draft head scoring ids
    [0, 8) alone (the context's ids not added), so of the cycle it can draft 5 only (and drafts others the
    target never draws); and a draft whose table is 8 ids longer (its scores past the target's left out)."""
    seen = _watched(monkeypatch)
    kw = {"lookup": 2} if source == "lookup" else {"draft": DraftModel(models[1], 2)}
    if source == "padded draft":
        kw["draft"] = DraftModel(padded, 2)
    if source == "partial draft vocabulary":
        kw["draft"] = DraftModel(models[1], 2, vocab=8)
        monkeypatch.setattr(kw["draft"].part, "hold", lambda context: None)
    counts = sampled(*_generator(models[0], **kw))
    kept = sum(d == t for d, t in seen)
    assert len(seen) > RUNS and kept > 0.1 * len(seen) and len(seen) - kept > 0.05 * len(seen)  # both ways
    assert p_value(counts, truth) > 1e-3
    assert source != "partial draft vocabulary" or {d for d, t in seen if d == t} == {CYCLE[0]}


def test_keeping_every_draft_fails_the_test(models, truth, monkeypatch) -> None:
    """The test can fail: a rule that keeps each lookup draft changes the distribution."""

    def greedy_keep(gen, logits, draft, q):
        if draft is None:
            return gen.next_token(logits)
        gen.take(draft)
        return draft

    monkeypatch.setattr(speculative, "choose", greedy_keep)
    assert p_value(sampled(*_generator(models[0], lookup=2)), truth) < 1e-6


def test_a_seed_repeats_a_speculative_run(models) -> None:
    """The target's seed alone repeats a run with a draft model (its drafts are drawn from the same stream);
    another seed gives another run."""
    runs = []
    for seed in (0, 0, 1):
        gen, logits = _generator(models[0], draft=DraftModel(models[1], 3))
        gen.rng.manual_seed(seed)
        runs.append(list(gen.decode(logits, 20)))
    assert runs[0] == runs[1] != runs[2]


def test_broken_logits_are_refused_with_drafts(models) -> None:
    """NaN logits fail the draw with a ValueError as plain sampling's do, drafts or not."""
    gen, logits = _generator(models[0], lookup=2)
    with pytest.raises(ValueError, match="cannot sample"):
        speculative.choose(gen, torch.full_like(logits, float("nan")), CYCLE[0], None)
