"""A prompt whose first tokens a slot holds from an earlier request, against the same prompt sent fresh.

Slot 0 first reads another prompt that shares the first ``k`` tokens (its cells written by that prompt's
prefill chunk), then the prompt itself with ``cache_prompt`` (the rest written by a chunk of its own);
slot 1 reads the prompt with ``cache_prompt`` false. Prints, per ``k``, the largest difference of the
logits after the prompt, and whether greedy replies of ``--max-tokens`` agree (docs/serve.md cites it).

    python experiments/server/cached_prefix_vs_fresh.py [--weights gguf] [-g 4 -w 256] [--cached 71,189,325]
"""

from __future__ import annotations

import argparse

import torch
from continued_vs_fresh import ask

import selfextend
from selfextend.evaluation.corpus import default_books
from selfextend.models import load_model
from selfextend.server.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--weights", default="gguf")
    parser.add_argument("-g", "--group-size", type=int, default=0, help="Self-Extend G (0: plain attention)")
    parser.add_argument("-w", "--window", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=379, help="prompt length, from the first default book")
    parser.add_argument("--cached", default="71,189,325", help="prefix lengths the slot holds")
    parser.add_argument("--max-tokens", type=int, default=100)
    args = parser.parse_args()
    model, tok = load_model(args.model, weights=args.weights)
    if args.group_size:
        selfextend.apply_self_extend(model, args.group_size, args.window)
    ids = tok(default_books()["sherlock-holmes"][: 8 * args.tokens]).input_ids[: args.tokens]
    other = tok(" zebra crossing", add_special_tokens=False).input_ids
    engine = Engine(model, tok, 1024, parallel=2)
    engine.start()
    try:
        for k in (int(x) for x in args.cached.split(",")):
            logits = []
            for n in (1, args.max_tokens):  # the logits after the prompt; then a greedy reply
                ask(engine, ids[:k] + other, 0, True, 1)
                a, done = ask(engine, ids, 0, True, n)
                la = engine.slots[0].gen.last_logits
                b, _ = ask(engine, ids, 1, False, n)
                logits.append(float((la - engine.slots[1].gen.last_logits).abs().max()))
            print(
                f"{k} of {len(ids)} tokens cached ({done['cached_tokens']} reused): logits after the prompt "
                f"differ by up to {logits[0]:.3g}; same {args.max_tokens}-token reply: {a == b}"
            )
    finally:
        engine.stop()


if __name__ == "__main__":
    with torch.no_grad():
        main()
