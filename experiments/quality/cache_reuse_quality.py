"""What reusing moved chunks (``selfextend serve --cache-reuse``) costs in quality, on the default model.

A front-trimming client: the old prompt is a system part S and messages m1..mK; the new prompt drops
the oldest D messages, S + m(D+1)..mK, and goes on with a continuation C. Two ways to read C:

- reuse: the slot's cache held the old prompt; the server keeps S (common prefix) and moves the cells of
  m(D+1)..mK down by K-shift (``selfextend.server.slots``, as llama-server's --cache-reuse). Those cells
  were computed while m1..mD were still before them, in every layer above the first, and were rotated
  once more;
- recompute: a fresh forward over S + m(D+1)..mK + C.

Both score C[1:] (the logits at C's positions, teacher-forced); reported: mean NLL per token and its
perplexity for each, their difference, and the largest absolute difference of the logits. Texts: windows
of the default corpus (War and Peace), one per trial.

    python experiments/quality/cache_reuse_quality.py          # appends to results/cache_reuse_quality.jsonl
    python experiments/quality/cache_reuse_quality.py --table  # the README's table from that file
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from selfextend.evaluation.corpus import default_books
from selfextend.hf.facts import cache_kwargs
from selfextend.hf.patch import apply_self_extend
from selfextend.models import load_model
from selfextend.server.slots import Slot

OUT = Path(__file__).parent / "results" / "cache_reuse_quality.jsonl"


def score(model, cache, cont: list[int]) -> torch.Tensor:
    """Logits (len(cont), vocab) of a forward over ``cont`` after what ``cache`` holds (or nothing)."""
    with torch.no_grad():
        out = model(torch.tensor([cont]), **cache_kwargs(model, cache), use_cache=cache is not None)
    return out.logits[0].float()


def nll(logits: torch.Tensor, cont: list[int]) -> float:
    return float(F.cross_entropy(logits[:-1], torch.tensor(cont[1:])))


def trial(model, ids: list[int], args) -> dict:
    s = ids[: args.system]
    pos = args.system
    msgs = [ids[pos + i * args.message : pos + (i + 1) * args.message] for i in range(args.messages)]
    pos += args.messages * args.message
    cont = ids[pos : pos + args.cont]
    old = s + sum(msgs, [])
    kept = s + sum(msgs[args.drop :], [])
    slot = Slot(0, model, n_ctx=len(old) + len(cont) + 8)
    gen = slot.generator(len(s))
    gen.feed(old)
    slot.finish(old, [], True)
    reuse = slot.prepare(kept + cont, len(s), min_chunk=args.min_chunk)
    assert reuse.tokens == len(kept), (reuse, len(kept))
    reused = score(model, gen.cache, cont)
    fresh = score(model, None, kept + cont)[len(kept) :]
    return {
        "nll_reuse": nll(reused, cont),
        "nll_recompute": nll(fresh, cont),
        "max_abs_logit_diff": float((reused - fresh).abs().max()),
        "moved": reuse.moved,
        "moved_by": args.drop * args.message,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--weights", default="float", choices=["float", "int8", "int4"])
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--system", type=int, default=64, help="tokens of the system part S")
    p.add_argument("--messages", type=int, default=8, help="messages K in the old prompt")
    p.add_argument("--message", type=int, default=96, help="tokens per message")
    p.add_argument("--drop", type=int, nargs="+", default=[1, 4], help="oldest messages D the client drops")
    p.add_argument("--cont", type=int, default=256, help="tokens of the scored continuation C")
    p.add_argument("--min-chunk", type=int, default=64, help="--cache-reuse")
    p.add_argument("-g", "--group-size", type=int, default=None)
    p.add_argument("-w", "--window", type=int, default=None)
    p.add_argument("--table", action="store_true", help="print the summary table of the results file")
    args = p.parse_args()
    if args.table:
        return table()
    model, tok = load_model(args.model, weights=args.weights)
    if args.group_size:
        apply_self_extend(model, args.group_size, args.window)
    text = default_books()["war-and-peace"]
    ids = tok(text[:400_000]).input_ids
    span = args.system + args.messages * args.message + args.cont
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("a") as f:
        for drop in args.drop:
            args.drop = drop
            for t in range(args.trials):
                start = 5_000 + t * (span + 1000)
                rec = trial(model, ids[start : start + span], args)
                rec.update(
                    model=args.model,
                    weights=args.weights,
                    self_extend=[args.group_size, args.window] if args.group_size else None,
                    drop=drop,
                    trial=t,
                    system=args.system,
                    messages=args.messages,
                    message=args.message,
                    cont=args.cont,
                )
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(json.dumps(rec))


def table() -> None:
    rows: dict[tuple, list[dict]] = {}
    for line in OUT.read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(
            (r["weights"], str(r["self_extend"]), r["drop"], r["messages"], r["message"]), []
        ).append(r)
    print(
        "| weights | Self-Extend | dropped / kept messages (tokens moved back) | trials | PPL recompute "
        "| PPL reuse | mean NLL diff (nats/token) | largest trial diff | max abs logit diff |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for (weights, se, drop, k, m), rs in rows.items():
        a = sum(r["nll_recompute"] for r in rs) / len(rs)
        b = sum(r["nll_reuse"] for r in rs) / len(rs)
        d = [r["nll_reuse"] - r["nll_recompute"] for r in rs]
        worst = max(r["max_abs_logit_diff"] for r in rs)
        print(
            f"| {weights} | {se} | {drop} / {k - drop} ({drop * m}) | {len(rs)} | {math.exp(a):.3f} "
            f"| {math.exp(b):.3f} | {sum(d) / len(d):+.4f} | {max(d, key=abs):+.4f} | {worst:.2f} |"
        )


if __name__ == "__main__":
    main()
