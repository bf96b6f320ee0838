"""What a reduced-precision KV cache (``--cache-type bf16|f16``) costs in perplexity, with Self-Extend.

The default model (float32 weights) reads the first ``L`` tokens of a default-corpus book in 512-token
pieces through a :class:`ContextShiftCache` of ``L`` cells whose elements are float32, bfloat16 or float16
(every piece attends the cells written before it, rounded as they are stored), with Self-Extend
(G=4, W=1024) so that 8k lies past nothing the model cannot reach; PPL over all predicted tokens.

    python experiments/quality/cache_type_ppl.py [--lengths 4096,8192] [--types f32,bf16,f16]

Rows go into results/cache_type_ppl.json, replacing those of the same length and cache type.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from selfextend.evaluation.corpus import default_books
from selfextend.generation.settings import CACHE_DTYPES
from selfextend.hf.facts import cache_kwargs
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model

OUT = Path(__file__).parent / "results" / "cache_type_ppl.json"
PIECE = 512


@torch.no_grad()
def ppl(model, ids: torch.Tensor, dtype: torch.dtype) -> float:
    """Perplexity of ``ids`` (1, L) read piece by piece through a cache of ``dtype`` cells."""
    cache = ContextShiftCache(model, n_ctx=ids.shape[1], dtype=dtype)
    nll, count = 0.0, 0
    for a in range(0, ids.shape[1], PIECE):
        piece = ids[:, a : a + PIECE]
        logits = model(piece, **cache_kwargs(model, cache), use_cache=True).logits[0]  # (piece, vocab)
        targets = ids[0, a + 1 : a + 1 + piece.shape[1]]
        nll += float(F.cross_entropy(logits[: len(targets)].float(), targets, reduction="sum"))
        count += len(targets)
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--types", default=",".join(CACHE_DTYPES), help="cache types, e.g. f32,bf16")
    args = parser.parse_args()
    types = args.types.split(",")
    if not set(types) <= set(CACHE_DTYPES):
        parser.error(f"--types: choose from {', '.join(CACHE_DTYPES)}")
    model, tokenizer = load_model("smollm2-135m")
    apply_self_extend(model, 4, 1024)
    text = tokenizer(default_books()["sherlock-holmes"][:200_000], return_tensors="pt").input_ids
    rows = json.loads(OUT.read_text())["rows"] if OUT.exists() else []
    for length in (int(x) for x in args.lengths.split(",")):
        for name in types:
            t0 = time.perf_counter()
            value = ppl(model, text[:, :length], CACHE_DTYPES[name])
            row = {"length": length, "cache_type": name, "ppl": value}
            row["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(row), flush=True)
            rows = [r for r in rows if (r["length"], r["cache_type"]) != (length, name)] + [row]
            rows.sort(key=lambda r: (r["length"], list(CACHE_DTYPES).index(r["cache_type"])))
            OUT.write_text(json.dumps({"group_size": 4, "window": 1024, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
