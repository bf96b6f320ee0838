"""Speculative decoding by prompt lookup (``--lookup``) against plain greedy decoding, rounds interleaved in
one process: tokens/s of each, their ratio per round, and whether the tokens are identical.

Two prompts: a paragraph to copy (lookup drafts nearly every token) and free text past the end of
sequence through context shifts (few drafts kept). The default model, ``--weights gguf`` (the
batch-invariant products the exact check needs).

    python experiments/speed/lookup_speed.py [--model smollm2-135m] [--rounds 3] [--lookup 8] [-t 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from selfextend.generation.generator import Generator
from selfextend.generation.sampling import SamplingParams
from selfextend.generation.text import build_prompt
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model

PARAGRAPH = (
    "The lighthouse keeper climbed the stairs each evening, lit the lamp, and wrote the weather in his log: "
    "wind from the west, rain by midnight, a ship's lights far out past the reef. He had kept the light for "
    "thirty years and never once let it go dark."
)
CASES = {  # name: (prompt, n_ctx, tokens, stop at end of sequence)
    "copy": (f"Repeat this text exactly, word for word: {PARAGRAPH}", 512, 80, True),
    "free, shifts": ("Tell me a long story about a lighthouse keeper.", 128, 300, False),
}


def timed(model, tokenizer, case: str, lookup: int) -> tuple[list[int], float, int]:
    """(tokens, tokens/s, context shifts) of one greedy run of ``case``."""
    text, n_ctx, n, at_eos = CASES[case]
    ids, _ = build_prompt(tokenizer, text)
    gen = Generator(
        model, ContextShiftCache(model, n_ctx, n_keep=4), SamplingParams(temperature=0), lookup=lookup
    )
    logits = gen.feed(ids)
    eos = (tokenizer.eos_token_id,) if at_eos else ()
    t0 = time.perf_counter()
    out = list(gen.decode(logits, n, eos))
    return out, len(out) / (time.perf_counter() - t0), gen.cache.shifts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lookup", type=int, default=8)
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    if args.rounds < 1 or args.lookup < 1 or args.threads < 1:
        parser.error("--rounds, --lookup and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, weights="gguf")
    for case in CASES:
        timed(model, tokenizer, case, args.lookup)  # warm-up
        for r in range(args.rounds):
            order = (0, args.lookup) if r % 2 == 0 else (args.lookup, 0)
            got = {k: timed(model, tokenizer, case, k) for k in order}
            (plain, rate0, shifts), (fast, rate1, _) = got[0], got[args.lookup]
            print(
                f"{case}, round {r}: plain {rate0:.1f} tok/s, --lookup {args.lookup} {rate1:.1f} tok/s: "
                f"{rate1 / rate0:.2f}x; {len(plain)} tokens, {shifts} shifts, identical: {plain == fast}",
                flush=True,
            )


if __name__ == "__main__":
    main()
