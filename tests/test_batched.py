"""The batched decode step against each sequence stepped alone, through context shifts at different times,
with and without Self-Extend, on tiny models of the families it serves (a Gemma 3 with sliding layers).

Two oracles: the single-sequence compiled step run eagerly (the path a lone request takes; float32, to
1e-5), and transformers' forward over the same caches (no shared attention code; to 1e-4 as in
test_compiled.py).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tiny_gemma3
from graph_replay import recorded

from selfextend.generation.batched import BatchedDecode
from selfextend.generation.compiled import FastDecode
from selfextend.generation.generator import Generator
from selfextend.generation.graphed import GraphedDecode
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache

N_CTX, N_KEEP, TOKENS = 40, 3, 48  # the first prompt shifts once, the last three times
PROMPTS = (1, 12, 29)  # different fills: the first starts below two cells, the others shift at other times
GROUP, WINDOW = 3, 7


def _model(family: str) -> torch.nn.Module:
    if family == "gemma3":
        return tiny_gemma3(["sliding_attention", "full_attention", "sliding_attention"], sliding_window=6)
    return make_model(family)


def _ids(seed: int) -> list[int]:
    return torch.randint(3, 90, (40 + TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generators(model: torch.nn.Module) -> tuple[list[Generator], list[list[int]]]:
    gens, seqs = [], []
    for seed, n in enumerate(PROMPTS):
        gen = Generator(model, ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP), direct_decode=False)
        ids = _ids(seed)
        gen.feed(ids[:n])
        gens.append(gen)
        seqs.append(ids[n : n + TOKENS])
    return gens, seqs


def _alone(model: torch.nn.Module, fast: FastDecode | None) -> tuple[torch.Tensor, list[int]]:
    """Each sequence stepped alone: (S, TOKENS, vocab) logits, and each one's shifts."""
    gens, seqs = _generators(model)
    out = []
    for gen, seq in zip(gens, seqs, strict=True):
        rows = []
        for t in seq:
            gen.make_room(1)
            logits = fast(t, gen.cache) if fast is not None else None
            if logits is None:
                logits = gen.write([t])
            else:
                gen.written([t], logits)
            rows.append(logits)
        out.append(torch.stack(rows))
    return torch.stack(out), [g.cache.shifts for g in gens]


def _together(model: torch.nn.Module) -> tuple[torch.Tensor, list[int], list[int]]:
    """The sequences stepped together: logits, shifts, and the batch sizes the shared forward ran."""
    decode = BatchedDecode(model, shared_from=2)
    sizes: list[int] = []
    rows_fn = decode.fast.step.rows

    def counted(tokens, *args):
        sizes.append(tokens.shape[0])
        return rows_fn(tokens, *args)

    decode.fast.step.rows = counted
    gens, seqs = _generators(model)
    steps = [decode(list(zip(gens, tokens, strict=True))) for tokens in zip(*seqs, strict=True)]
    logits = torch.stack([torch.stack(s) for s in steps], dim=1)  # (S, TOKENS, vocab)
    return logits, [g.cache.shifts for g in gens], sizes


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("extend", [False, True])
def test_batched_matches_each_alone(family: str, extend: bool) -> None:
    model = _model(family)
    if extend:
        apply_self_extend(model, GROUP, WINDOW)
    got, shifts, sizes = _together(model)
    single, shifts_single = _alone(model, FastDecode(model, compile=False))
    forward, shifts_forward = _alone(model, None)
    assert shifts == shifts_single == shifts_forward and min(shifts) >= 1 and len(set(shifts)) > 1
    assert max(sizes) == len(PROMPTS) and len(sizes) >= TOKENS // 2  # most steps shared one forward
    torch.testing.assert_close(got, single, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, forward, atol=1e-4, rtol=1e-4)


def test_unserved_model_steps_each_alone() -> None:
    """A family the step does not know: every sequence through its own forward, the same logits."""
    model = make_model("phi3")
    decode = BatchedDecode(model)
    assert not decode.serves()
    gens, seqs = _generators(model)
    together = torch.stack(
        [torch.stack(decode(list(zip(gens, t, strict=True)))) for t in zip(*seqs, strict=True)],
        dim=1,
    )
    forward, _ = _alone(model, None)
    torch.testing.assert_close(together, forward, atol=1e-5, rtol=1e-5)


def _counted(step) -> list[int]:
    """The row counts of every ``step.rows`` call from now on."""
    sizes: list[int] = []
    rows_fn = step.rows
    step.rows = lambda tokens, *args: sizes.append(len(tokens)) or rows_fn(tokens, *args)
    return sizes


def test_lone_sequence_takes_its_direct_step() -> None:
    """One sequence with a direct decode step of its own goes through it; two share the direct step's rows
    (the eager compiled step is not used)."""
    model = make_model("llama")
    decode = BatchedDecode(model, shared_from=2)
    eager = _counted(decode.fast.step)
    gens = []
    for seed in range(2):
        gen = Generator(model, ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP))
        gen.feed(_ids(seed)[:10])
        gens.append(gen)
    direct = _counted(gens[0].step)
    alone = decode([(gens[0], 5)])[0]
    assert direct == [1] and gens[0].tokens[-1] == 5  # __call__ is rows of one
    decode([(gens[0], 6), (gens[1], 6)])
    assert direct == [1, 2] and eager == []
    want = Generator(model, ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP), direct_decode=False)
    want.feed(_ids(0)[:10])
    torch.testing.assert_close(alone, want.write([5]), atol=1e-5, rtol=1e-5)


# bf16 cells with Self-Extend only: its window attends the cells as plain attention does, and groups the rest
ROW_CASES = [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize(("extend", "cells"), ROW_CASES, ids=["plain", "extend", "extend-bf16"])
def test_direct_rows_match_each_alone(family: str, extend: bool, cells: torch.dtype) -> None:
    """Sequences at different fills stepped together through the direct step's rows (shifting at different
    times) give each one's logits stepped alone, plain and Self-Extend, over float32 and bf16 cells (float
    weights: to float32 tolerance; GGUF blocks, whose products are batch-invariant: bit for bit, in
    test_gguf_blocks.py)."""
    model = _model(family)
    if extend:
        apply_self_extend(model, GROUP, WINDOW)
    decode = BatchedDecode(model)
    runs = []
    for together in (True, False):
        gens, seqs = [], []
        for seed, n in enumerate(PROMPTS):
            cache = ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP, dtype=cells)
            gen = Generator(model, cache)
            gen.feed(_ids(seed)[:n])
            gens.append(gen)
            seqs.append(_ids(seed)[n : n + TOKENS])
        assert all(g.step is not None and g.step.supported() for g in gens)
        if together:
            sizes = _counted(gens[0].step)
            logits = [decode(list(zip(gens, t, strict=True))) for t in zip(*seqs, strict=True)]
            assert sizes == [len(PROMPTS)] * TOKENS
        else:
            logits = [[g.write([t]) for g, t in zip(gens, ts, strict=True)] for ts in zip(*seqs, strict=True)]
        shifts = [g.cache.shifts for g in gens]
        runs.append((torch.stack([torch.stack(row) for row in logits]), shifts, [g.tokens for g in gens]))
    (got, shifts, tokens), (want, shifts_alone, tokens_alone) = runs
    assert shifts == shifts_alone and min(shifts) >= 1 and len(set(shifts)) > 1
    assert tokens == tokens_alone
    # float32 products of M rows and of one differ in the last bits; a bf16 cell rounds such a key either way
    tol = 1e-5 if cells == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("cells", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_captured_rows_match_each_alone(family: str, cells: torch.dtype) -> None:
    """A GPU's server slots: every row in one replay of the captured step (tests/graph_replay.py records
    it as a CUDA graph would), a graph per set of slots stepped together (all three, then every fifth token
    the first two), through shifts at different times: each one's logits stepped alone through the direct
    step."""
    model = _model(family)
    apply_self_extend(model, GROUP, WINDOW)
    graphs = []

    def capture(run):
        graphs.append(recorded(run))
        return graphs[-1]

    graphed = GraphedDecode(model, capture=capture, notify=pytest.fail)
    replays = _counted(graphed)
    runs = []
    for together in (True, False):
        gens, seqs = [], []
        for seed, n in enumerate(PROMPTS):
            gen = Generator(model, ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP, dtype=cells))
            gen.feed(_ids(seed)[:n])
            gen.fast = graphed if together else None
            gens.append(gen)
            seqs.append(_ids(seed)[n : n + TOKENS])
        logits = []
        for k, ts in enumerate(zip(*seqs, strict=True)):
            active = 2 if k % 5 == 4 else 3
            pairs = list(zip(gens[:active], ts, strict=False))
            got = BatchedDecode(model)(pairs) if together else [g.write([t]) for g, t in pairs]
            logits.extend(got)
        runs.append((torch.stack(logits), [g.cache.shifts for g in gens], [g.tokens for g in gens]))
    (got, shifts, tokens), (want, shifts_alone, tokens_alone) = runs
    assert shifts == shifts_alone and min(shifts) >= 1 and tokens == tokens_alone
    assert 2 <= len(graphs) <= 4 and replays.count(3) >= TOKENS // 2 and 2 in replays
    tol = 1e-5 if cells == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
