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

from selfextend.generation.batched import SHARED_FROM_ON_CPU, BatchedDecode
from selfextend.generation.compiled import FastDecode
from selfextend.generation.generator import Generator
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache

N_CTX, N_KEEP, TOKENS = 40, 3, 70
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


def test_lone_sequence_takes_its_direct_step() -> None:
    """One sequence with a direct decode step of its own goes through it; two share the batched forward."""
    model = make_model("llama")
    decode = BatchedDecode(model, shared_from=2)
    sizes: list[int] = []
    rows_fn = decode.fast.step.rows
    decode.fast.step.rows = lambda tokens, *args: sizes.append(tokens.shape[0]) or rows_fn(tokens, *args)
    gens = []
    for seed in range(2):
        gen = Generator(model, ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP))
        gen.feed(_ids(seed)[:10])
        gens.append(gen)
    alone = decode([(gens[0], 5)])[0]
    assert sizes == [] and gens[0].tokens[-1] == 5
    decode([(gens[0], 6), (gens[1], 6)])
    assert sizes == [2]
    want = Generator(model, ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP), direct_decode=False)
    want.feed(_ids(0)[:10])
    torch.testing.assert_close(alone, want.write([5]), atol=1e-5, rtol=1e-5)


def test_few_sequences_on_the_cpu_take_their_direct_steps() -> None:
    """On the CPU, fewer than SHARED_FROM_ON_CPU sequences are each written through their own direct step
    (bit for bit the logits it gets alone: a greedy reply does not depend on the requests beside it, issue
    30 item 7); that many share one forward."""
    model = make_model("llama")
    decode = BatchedDecode(model)
    assert decode.shared_from == SHARED_FROM_ON_CPU
    sizes: list[int] = []
    rows_fn = decode.fast.step.rows
    decode.fast.step.rows = lambda tokens, *args: sizes.append(tokens.shape[0]) or rows_fn(tokens, *args)
    gens, wants = [], []
    for seed in range(SHARED_FROM_ON_CPU):
        for out in (gens, wants):
            gen = Generator(model, ContextShiftCache(model, n_ctx=N_CTX, n_keep=N_KEEP))
            gen.feed(_ids(seed)[:10])
            out.append(gen)
    few = SHARED_FROM_ON_CPU - 1
    got = decode([(g, 7) for g in gens[:few]])
    assert sizes == []
    for g, want, logits in zip(gens, wants, got, strict=False):
        assert torch.equal(logits, want.write([7]))
        assert g.tokens == want.tokens
    decode([(g, 8) for g in gens])
    assert sizes == [SHARED_FROM_ON_CPU]
