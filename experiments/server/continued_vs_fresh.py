"""A greedy conversation continued turn by turn against the same turns sent fresh, on the server's engine.

Slot 0 takes each turn as a continuation (its cache holds the earlier prompts and replies, the replies'
cells as the decode step wrote them); slot 1 computes the same token ids from scratch (``cache_prompt``
false: every token but the last through prefill chunks). Prints, per turn, whether the replies agree and
the largest difference of the last logits (docs/serve.md cites it).

    python experiments/server/continued_vs_fresh.py [--model smollm2-135m] [--weights gguf] [--turns 3]
"""

from __future__ import annotations

import argparse

import torch

from selfextend.generation.sampling import SamplingParams
from selfextend.models import load_model
from selfextend.server.engine import Engine, Job
from selfextend.server.jobs import Reply

QUESTIONS = [
    "Name three colours of the sea.",
    "Which of them is darkest?",
    "Why is that?",
    "And at night?",
]


def ask(engine: Engine, ids: list[int], slot: int, cache: bool, max_tokens: int) -> tuple[str, dict]:
    """(text, done event) of one greedy job on ``slot``."""
    reply = Reply()
    sampling = SamplingParams(temperature=0)
    engine.submit(Job(list(ids), 0, sampling, max_tokens, reply.emit, slot_id=slot, cache_prompt=cache))
    text, last = reply.wait(600)
    if last["type"] != "done":
        raise RuntimeError(last)
    return text, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default="gguf")
    parser.add_argument("--turns", type=int, default=3, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    model, tok = load_model(args.model, weights=args.weights)
    engine = Engine(model, tok, 1024, parallel=2)
    engine.start()
    system = [{"role": "system", "content": "You are a helpful assistant."}]
    try:
        for i, question in enumerate(QUESTIONS[: args.turns]):
            user = [{"role": "user", "content": question}]
            if i == 0:
                text = tok.apply_chat_template(system + user, add_generation_prompt=True, tokenize=False)
                ids = tok(text, add_special_tokens=False).input_ids
            else:  # the slot's tokens (the reply but its last token) and the next turn, as ids
                whole = tok.apply_chat_template(system + user, add_generation_prompt=True, tokenize=False)
                alone = tok.apply_chat_template(system, tokenize=False)
                turn = tok.eos_token + "\n" + whole[len(alone) :]
                ids = list(engine.slots[0].gen.tokens) + tok(turn, add_special_tokens=False).input_ids
            a, done = ask(engine, ids, 0, True, args.max_tokens)
            b, _ = ask(engine, ids, 1, False, args.max_tokens)
            la, lb = engine.slots[0].gen.last_logits, engine.slots[1].gen.last_logits
            print(
                f"turn {i + 1}: prompt {len(ids)} tokens, {done['cached_tokens']} cached; "
                f"same reply: {a == b}; "
                f"last logits differ by up to {float((la - lb).abs().max()):.3g} "
                f"(largest {float(la.abs().max()):.3g})"
            )
            if a != b:
                print(f"  continued: {a!r}\n  fresh:     {b!r}")
    finally:
        engine.stop()


if __name__ == "__main__":
    with torch.no_grad():
        main()
