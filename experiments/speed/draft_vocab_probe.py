"""What a draft model gains when its output layer scores only part of the vocabulary: the first N token ids
and the ids of the prompt (a probe for issue 50's Gemma pair, not a feature).

Why: Gemma 3's 262,144-entry output layer is 60% of both its Q4_K_M draft's step and its F16 target's,
so a draft costs 0.6 of a target step and speculative decoding gains ~1.1x. Drafts need not be exact
(the target's check keeps the output plain greedy's), so the draft's head may score fewer rows, as
FR-Spec (2025) does with a frequency-ranked subset. Here the subset is the first N ids (a view of the
head's blocks) plus the prompt's ids (their rows dequantized once); every other logit is -inf. The
draft's step object has its head swapped in place, in this process only. Greedy, in process, rounds
interleaved (plain, full draft head, part of it): tok/s, drafts and drafts kept; every run's tokens are
checked equal to plain's.

    python experiments/speed/draft_vocab_probe.py --ids 32768,65536 --rounds 2 \\
        --model /work/dev-models/gemma-3-270m-q4_k_m.F16.gguf \\
        --draft ~/.cache/selfextend/gguf/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from selfextend.generation.draft import DraftModel
from selfextend.generation.generator import Generator
from selfextend.kv.cache import ContextShiftCache
from selfextend.models.load import load_model
from selfextend.native.quant import quant_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_vs_llamacpp import PROMPTS  # noqa: E402


def part_of_head(step, head, n: int, context: list[int]) -> None:
    """``step``'s head made to score ids ``[0, n)`` (the head's first blocks, in place) and ``context``'s."""
    kernels, vocab = quant_kernels(), head.out_features
    first = head.blocks[:n]  # rows in order (an interleaved form: groups of 8 in order, n a multiple of 8)
    extra = torch.tensor(sorted({t for t in context if t >= n}), dtype=torch.long)
    rows = kernels.rows(head.blocks, head.kind, head.in_features, extra) if len(extra) else None  # (E, K)

    def product(x: torch.Tensor) -> torch.Tensor:
        y = kernels(x, first, head.kind, torch.bfloat16)  # (M, n)
        out = torch.full((x.shape[0], vocab), float("-inf"), dtype=y.dtype)
        out[:, :n] = y
        if rows is not None:
            out[:, extra] = (x.float() @ rows.T).to(y.dtype)
        return out

    step.head_product = product


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the target GGUF")
    parser.add_argument("--draft", required=True, help="the draft GGUF (the same vocabulary)")
    parser.add_argument("--ids", default="65536", help="first ids the draft's head scores, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--draft-max", type=int, default=16)
    args = parser.parse_args()
    model, tok = load_model(args.model, weights="gguf")
    draft_model, _ = load_model(args.draft, weights="gguf")
    parts = [int(n) for n in args.ids.split(",")]
    for rnd in range(args.rounds):
        for name, text in PROMPTS.items():
            ids = tok(text)["input_ids"]
            rates, plain = {}, None
            for variant in ["plain", "draft", *parts]:
                gen = Generator(model, ContextShiftCache(model, n_ctx=1024, dtype=torch.float16))
                if variant != "plain":
                    gen.draft = DraftModel(draft_model, args.draft_max, torch.float16)
                logits = gen.feed(ids)
                if isinstance(variant, int):
                    part_of_head(gen.draft.gen.step, draft_model.lm_head, variant, ids)
                t0 = time.perf_counter()
                tokens = list(gen.decode(logits, args.tokens))
                rate = len(tokens) / (time.perf_counter() - t0)
                plain = tokens if plain is None else plain
                assert tokens == plain, f"{variant}: not plain greedy's tokens"
                rates[str(variant)] = (round(rate, 1), gen.drafted, gen.kept)
            ratios = {k: round(v[0] / rates["plain"][0], 2) for k, v in rates.items() if k != "plain"}
            print(f"round {rnd}, {name}: (tok/s, drafted, kept) {rates}; over plain {ratios}", flush=True)


if __name__ == "__main__":
    main()
