"""Where one eager decode step's time goes: the direct step's layer loop with one part left out at a time.

SmolLM2 (``--weights auto``: int4), a cache filled with 1,500 tokens, 2 threads. The loop is the one of
:class:`~selfextend.generation.decode.DecodeStep` (plain attention), written out here so that a part can be
replaced by a tensor of the right shape: attention (the query passes through), the projections (fixed
outputs), the norms (identity), the output head. Milliseconds per step, each the mean of 100 steps after 5,
for a float32 and a bfloat16 cache; rounds alternate. The differences are what each part costs; it does not
write the new token's cells (every step reads the same 1,500), so it measures reading, not the cache.

    python experiments/decode_ablation.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from selfextend.core.rope import Rotation
from selfextend.generation.decode import DecodeStep
from selfextend.generation.generator import CACHE_DTYPES, Generator
from selfextend.generation.products import project
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model

FILL = 1500
PARTS = ("attention", "projections", "norms", "head")


@torch.no_grad()
def step(st: DecodeStep, cache: ContextShiftCache, without: str | None) -> torch.Tensor:
    """One token at position FILL through the layers, ``without`` one of :data:`PARTS`."""
    x = st.embed_rows(torch.tensor([5])).view(1, 1, -1)  # (1, 1, hidden)
    rot = Rotation.from_cos_sin(*(t[:, None] for t in st.rotary(x, torch.tensor([[FILL]]))))
    d, n_qk = st.head_dim, st.heads[0] + st.heads[1]
    cells_type = cache.layers[0].keys.dtype
    fixed_qkv = torch.randn(1, 1, (st.heads[0] + 2 * st.heads[1]) * d)
    fixed_hidden, fixed_up = (
        torch.randn(1, 1, x.shape[-1]),
        torch.randn(1, 1, 2 * st.layers[0].mlp.up_proj.out_features),
    )
    norm = (lambda m, h: h) if without == "norms" else (lambda m, h: m.forward(h))
    for i, layer in enumerate(st.layers):
        attn = layer.self_attn
        h = norm(layer.input_layernorm, x)
        qkv = fixed_qkv if without == "projections" else project(st.qkv[i], h)
        q, _ = rot.apply(qkv.view(1, 1, -1, d).transpose(1, 2)[:, :n_qk]).split(st.heads[:2], dim=1)
        if without == "attention":
            out = q  # (1, H, 1, D)
        else:
            k, v = cache.layers[i].keys[:, :, :FILL], cache.layers[i].values[:, :, :FILL]  # (1, Hkv, FILL, D)
            out = F.scaled_dot_product_attention(q.to(cells_type), k, v, scale=attn.scaling, enable_gqa=True)
            out = out.to(x.dtype)
        out = out.transpose(1, 2).reshape(1, 1, -1)
        x = x + (fixed_hidden if without == "projections" else attn.o_proj.forward(out))
        h = norm(layer.post_attention_layernorm, x)
        gate, up = (fixed_up if without == "projections" else project(st.gate_up[i], h)).chunk(2, dim=-1)
        x = x + (fixed_hidden if without == "projections" else layer.mlp.down_proj.forward(F.silu(gate) * up))
    return x if without == "head" else st.head.forward(norm(st.norm, x))[0, -1]


def milliseconds(st: DecodeStep, cache: ContextShiftCache, without: str | None) -> float:
    for _ in range(5):
        step(st, cache, without)
    t0 = time.perf_counter()
    for _ in range(100):
        step(st, cache, without)
    return (time.perf_counter() - t0) * 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model("smollm2-135m", weights="auto")
    prompt = torch.randint(100, 40000, (FILL,), generator=torch.Generator().manual_seed(0)).tolist()
    setups = {}
    for name in ("f32", "bf16"):
        gen = Generator(model, ContextShiftCache(model, n_ctx=2048, n_keep=4, dtype=CACHE_DTYPES[name]))
        gen.feed(prompt)
        setups[name] = (gen.step, gen.cache)
    for r in range(args.rounds):
        for name, (st, cache) in setups.items():
            full = milliseconds(st, cache, None)
            parts = {p: full - milliseconds(st, cache, p) for p in PARTS}
            shown = ", ".join(f"{p} {ms:.1f}" for p, ms in parts.items())
            print(
                f"round {r}, {name} cache: step {full:.1f} ms; parts (ms): {shown}; "
                f"the rest {full - sum(parts.values()):.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
