"""Passkey retrieval past the trained window with each KV cache element type, as ``generate`` runs it.

The default model as ``generate`` loads it (int4 weights from the GGUF), Self-Extend G=4, W=1024, reads
``selfextend passkey``'s prompt (a 5-digit key at a relative depth of repeated filler) into a cache of
f32, bf16 or f16 cells and answers greedily through the direct decode step; each (length, depth) point asks
every cache type the same key in turn. Records are appended to results/cache_type_passkey.jsonl as they are
produced; a rerun skips the points already there.

    python experiments/quality/cache_type_passkey.py [--lengths 8192,16384] [--depths 0.1,0.5,0.9] \
        [--types f32,bf16]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from selfextend.evaluation.passkey import ANSWER_TOKENS, build_passkey_prompt, is_correct
from selfextend.evaluation.results import append_jsonl, read_jsonl
from selfextend.generation.generator import Generator
from selfextend.generation.settings import CACHE_DTYPES
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model

OUT = Path(__file__).parent / "results" / "cache_type_passkey.jsonl"


@torch.no_grad()
def ask(model: torch.nn.Module, ids: list[int], dtype: torch.dtype) -> list[int]:
    """Greedy answer tokens after ``ids``, read into a cache of ``dtype`` cells."""
    gen = Generator(model, ContextShiftCache(model, len(ids) + ANSWER_TOKENS + 1, dtype=dtype))
    return list(gen.decode(gen.feed(ids), ANSWER_TOKENS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,16384", help="prompt lengths in tokens")
    parser.add_argument("--depths", default="0.1,0.5,0.9", help="relative depths of the key")
    parser.add_argument("--types", default="f32,bf16", help="cache types, e.g. f32,bf16,f16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    types = args.types.split(",")
    if not set(types) <= set(CACHE_DTYPES):
        parser.error(f"--types: choose from {', '.join(CACHE_DTYPES)}")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("smollm2-135m", weights="auto")
    apply_self_extend(model, 4, 1024)
    done = {(r["length"], r["depth"], r["cache_type"]) for r in read_jsonl(OUT)} if OUT.exists() else set()
    for length in (int(x) for x in args.lengths.split(",")):
        for depth in (float(x) for x in args.depths.split(",")):
            key = random.Random(f"cache-type-{length}-{depth}").randint(10000, 99999)
            ids = build_passkey_prompt(tokenizer, length, depth, key)
            for name in types:
                if (length, depth, name) in done:
                    continue
                t0 = time.perf_counter()
                text = tokenizer.decode(ask(model, ids, CACHE_DTYPES[name]), skip_special_tokens=True)
                record = {
                    "length": length,
                    "depth": depth,
                    "cache_type": name,
                    "passkey": key,
                    "answer": text.strip(),
                    "correct": is_correct(text, key),
                    "tokens": len(ids),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
                append_jsonl(OUT, record)
                print(record, flush=True)


if __name__ == "__main__":
    main()
