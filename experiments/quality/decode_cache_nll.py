"""What the KV cache's element type costs when decoding: teacher-forced NLL through the decode step.

The default model (``--weights auto``) reads the first ``--prompt`` tokens of a default-corpus book, then
the next ``--tokens`` one at a time through a :class:`Generator` (the direct decode step: with a bf16 or
f16 cache, plain attention reads the cells as stored and rounds the query to their type) in a
``--ctx``-cell context-shift cache, so several shifts happen; for each cache type: the perplexity of
those tokens, the largest logit difference from the float32 cache, and how often the argmax agrees.

    python experiments/quality/decode_cache_nll.py   # writes results/decode_cache_nll.json (~3 minutes)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from selfextend.evaluation.corpus import default_books
from selfextend.generation.generator import Generator
from selfextend.generation.settings import CACHE_DTYPES
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model

OUT = Path(__file__).parent / "results" / "decode_cache_nll.json"


@torch.no_grad()
def run(model, ids: list[int], prompt: int, ctx: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Logits (tokens, vocab) predicting ``ids[prompt + 1:]``, one token at a time; and the shifts."""
    gen = Generator(model, ContextShiftCache(model, n_ctx=ctx, n_keep=4, dtype=dtype))
    rows = [gen.feed(ids[:prompt])]
    rows += [gen.write([t]) for t in ids[prompt:-1]]
    return torch.stack(rows), gen.cache.shifts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, weights="auto")
    title, text = next(iter(default_books().items()))
    ids = tokenizer(text)["input_ids"][: args.prompt + args.tokens + 1]
    targets = torch.tensor(ids[args.prompt :])
    base = None
    results = {}
    for name in ("f32", "bf16", "f16"):
        logits, shifts = run(model, ids, args.prompt, args.ctx, CACHE_DTYPES[name])
        nll = F.cross_entropy(logits.float(), targets).item()
        row = {"ppl": round(math.exp(nll), 4), "shifts": shifts}
        if base is None:
            base = logits
        else:
            row["max_logit_diff"] = round((logits - base).abs().max().item(), 4)
            row["argmax_agrees"] = round((logits.argmax(-1) == base.argmax(-1)).float().mean().item(), 4)
        results[name] = row
        print(name, json.dumps(row), flush=True)
    record = {"model": args.model, "book": title, **vars(args), "out": None, "results": results}
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
