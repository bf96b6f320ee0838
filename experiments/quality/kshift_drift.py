"""K-shift drift: what repeated re-rotation does to cached keys, and how often a key is re-rotated.

A context shift re-rotates every surviving key by ``-n_discard`` (selfextend.kv.cache, through
selfextend.core.rope.rotate) and stores it back in the cache's dtype. A key that survives many shifts is
rotated many times, each adding rounding error. This script, on the real default model (SmolLM2-135M,
float32 weights; caches of float32, bfloat16 and float16 cells, as ``--cache-type`` f32, bf16, f16):

1. captures the un-rotated keys of 64 tokens of the default corpus in every layer (k_proj outputs),
2. shifts the cache 1, 10, 100 and 1000 times by -1024 positions (what one shift of a full --ctx 2048
   cache discards) through the cache's own ContextShiftLayer.shift,
3. compares the cached keys with the same keys rotated once, in float32, from their un-rotated value to
   their current position (largest absolute difference, over all layers, heads, cells), and the
   next-token logits computed from the two caches,
4. counts, by bookkeeping with the cache's own discard rule, how many shifts any key survives in an
   endless run (decode one token at a time) and in a ppl shift sweep (writes of 256 tokens).

    python experiments/quality/kshift_drift.py   # writes experiments/quality/results/kshift_drift.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from selfextend.core.rope import find_rotary_embedding, rotate
from selfextend.evaluation.corpus import default_books
from selfextend.hf.facts import cache_kwargs
from selfextend.kv.cache import ContextShiftCache, discard_count
from selfextend.models import load_model

COUNTS = (1, 10, 100, 1000)
N_TOKENS = 64
N_DISCARD = 1024
OUT = Path(__file__).parent / "results" / "kshift_drift.json"


def raw_keys(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's keys before RoPE, (1, Hkv, L, D), from hooks on the k projections."""
    keys: list[torch.Tensor] = []
    heads = model.config.num_key_value_heads
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(
            lambda m, i, o: keys.append(o.detach().float().view(1, o.shape[1], heads, -1).transpose(1, 2))
        )
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return keys


def shift_probes(layer, n: int, inv_freq: torch.Tensor) -> None:
    """One real context shift of the ``n`` cached cells by -N_DISCARD: they are placed after N_DISCARD
    cells to be dropped (an exact copy), then ContextShiftLayer.shift drops those and re-rotates them."""
    layer.keys[..., N_DISCARD : N_DISCARD + n, :] = layer.keys[..., :n, :].clone()
    layer.values[..., N_DISCARD : N_DISCARD + n, :] = layer.values[..., :n, :].clone()
    layer.n_past = N_DISCARD + n
    layer.shift(0, N_DISCARD, inv_freq)


@torch.no_grad()
def next_logits(model, cache: ContextShiftCache, token: int, position: int) -> torch.Tensor:
    """Logits of ``token`` read at ``position`` against what ``cache`` holds (the cache is left as it was)."""
    n = cache.n_past
    out = model(
        torch.tensor([[token]]), **cache_kwargs(model, cache), position_ids=torch.tensor([[position]])
    )
    cache.truncate(n)
    return out.logits[0, -1].float()


def drift(dtype: torch.dtype, text_ids: torch.Tensor) -> list[dict]:
    """Drift of keys and logits in a cache of ``dtype`` cells (float32 weights) after 1 .. 1000 shifts."""
    model, _ = load_model("smollm2-135m")
    inv_freq = find_rotary_embedding(model).inv_freq
    ids, probe = text_ids[:, :N_TOKENS], int(text_ids[0, N_TOKENS])
    raw = raw_keys(model, ids)  # float32, un-rotated
    cache = ContextShiftCache(model, N_DISCARD + N_TOKENS, dtype=dtype)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))  # keys rotated by the model's own RoPE at 0..N-1
    values = [layer.values[..., :N_TOKENS, :].clone() for layer in cache.layers]
    rows, done = [], 0
    for count in (0, *COUNTS):
        for _ in range(count - done):
            for layer in cache.layers:
                shift_probes(layer, N_TOKENS, inv_freq)
        done = count
        positions = torch.arange(N_TOKENS) - count * N_DISCARD
        once = [rotate(k, positions, inv_freq) for k in raw]  # float32, one rotation from the raw key
        key_diff = max(
            float((layer.keys[..., :N_TOKENS, :].float() - r).abs().max())
            for layer, r in zip(cache.layers, once, strict=True)
        )
        ref = ContextShiftCache(model, N_DISCARD + N_TOKENS, dtype=dtype)
        ref.load_prefix([r.to(dtype) for r in once], values)
        position = N_TOKENS - count * N_DISCARD
        shifted, reference = (
            next_logits(model, cache, probe, position),
            next_logits(model, ref, probe, position),
        )
        rows.append(
            {
                "cache_dtype": str(dtype).removeprefix("torch."),
                "shifts": count,
                "max_key_diff": key_diff,
                "max_key_abs": max(float(r.abs().max()) for r in once),
                "max_logit_diff": float((shifted - reference).abs().max()),
                "same_argmax": bool(shifted.argmax() == reference.argmax()),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def max_rotations(n_ctx: int, n_keep: int, chunk: int, tokens: int) -> int:
    """How many shifts the longest-lived cell survives when ``tokens`` are written ``chunk`` at a time
    (bookkeeping only, with the cache's own make_room rule and discard count)."""
    rotations: list[int] = []  # per cached cell after the kept ones
    worst = 0
    for _ in range(0, tokens, chunk):
        while n_keep + len(rotations) + chunk > n_ctx:
            n_discard = discard_count(n_keep + len(rotations), n_keep)
            rotations = [r + 1 for r in rotations[n_discard:]]
            worst = max([worst, *rotations])
        rotations += [0] * chunk
    return worst


def main() -> None:
    text_ids = load_model("smollm2-135m")[1](
        default_books()["sherlock-holmes"][:4000], return_tensors="pt"
    ).input_ids
    rows = [row for dtype in (torch.float32, torch.bfloat16, torch.float16) for row in drift(dtype, text_ids)]
    practice = {
        "decode, --ctx 2048, keep 4, 100k tokens": max_rotations(2048, 4, 1, 100_000),
        "ppl shift:ctx=2048,keep=4, 256-token writes, 100k tokens": max_rotations(2048, 4, 256, 100_000),
    }
    print(json.dumps(practice))
    OUT.write_text(json.dumps({"rows": rows, "max_rotations_in_practice": practice}, indent=1) + "\n")


if __name__ == "__main__":
    main()
