"""Would a compiled decode step help on this CPU? StaticCache decoding, eager against torch.compile.

The default model with int8 weights decodes greedily from a 1024-token prompt in a 2048-cell
``StaticCache`` (static shapes, the layout transformers documents for ``torch.compile``), first
eagerly, then through ``torch.compile`` (inductor, default mode), after one warm-up call.

    python experiments/speed/compile_probe.py [--tokens 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import StaticCache

from selfextend.hf.facts import cache_kwargs
from selfextend.models import load_model
from selfextend.models.quantize import quantize_int8

PROMPT = 1024
OUT = Path(__file__).parent / "results" / "compile_probe.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model()
    quantize_int8(model)
    cache = StaticCache(config=model.config, max_cache_len=2048)
    ids = torch.randint(100, 40000, (1, PROMPT), generator=torch.Generator().manual_seed(0))

    def step(token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = model(
            token, **cache_kwargs(model, cache), use_cache=True, cache_position=pos, position_ids=pos[None]
        )
        return out.logits[:, -1:].argmax(-1)

    def rate(fn, start: int, n: int, token: torch.Tensor) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        for i in range(n):
            token = fn(token, torch.tensor([start + i]))
        return n / (time.perf_counter() - t0), token

    with torch.no_grad():
        logits = model(
            ids, **cache_kwargs(model, cache), use_cache=True, cache_position=torch.arange(PROMPT)
        ).logits
        token = logits[:, -1:].argmax(-1)
        eager, token = rate(step, PROMPT, args.tokens, token)
        compiled_step = torch.compile(step)
        t0 = time.perf_counter()
        _, token = rate(compiled_step, PROMPT + args.tokens, 1, token)
        compile_s = time.perf_counter() - t0
        compiled, _ = rate(compiled_step, PROMPT + args.tokens + 1, args.tokens, token)
    result = {"eager_tokens_per_s": eager, "compiled_tokens_per_s": compiled, "first_call_s": compile_s}
    print(json.dumps(result))
    OUT.write_text(json.dumps({**result, "tokens": args.tokens, "threads": args.threads}) + "\n")


if __name__ == "__main__":
    main()
