"""The fused decode kernels against the decode step's tensor ops (``attend``), case by case, in Triton's
interpreter; then the static step of generation/graphed.py with the kernels taken against the direct step.

Run by tests/test_fused_decode.py in a subprocess with ``TRITON_INTERPRET=1`` (it must be set before
triton is imported, and the suite's worker has imported it already): prints one JSON line per case, the
largest difference from ``attend`` with the kernels refused and the tolerance, then the calls that went
through ``attend``'s dispatch, then the static step's largest logit difference over a few tokens (a Llama,
a Gemma 3).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import selfextend.generation.step_attention as step_attention
from selfextend.core.decode_query import grouped_keys
from selfextend.core.fused_decode import DecodeConfig, fused_decode_attention
from selfextend.generation.step_attention import GroupedRotations, attend

TOL = 1e-5  # both sides compute in float32 from the same inputs, whatever their dtype
SMALL = DecodeConfig(16, 32, 4)  # tiles of 16 cells, runs of 32: several runs to merge, tiles cut by n

# (name, H, Hkv, D, n, dtype, G, W, sliding window, layout, rot_dim, tiles): G 1 = plain; layout "ordered"
# (positions 100 + slot), "ring" (a sliding ring: the same positions rolled), "unused" (the last third of
# the slots past the last in use, holding stale positions, as the static step leaves them); rot_dim None =
# D; tiles None = through attend's
# dispatch with the default tiles
CASES = [
    ("plain 4/1 d16 37", 4, 1, 16, 37, torch.float32, 1, 0, None, "ordered", None, SMALL),
    ("plain 2/2 d64 n1", 2, 2, 64, 1, torch.float32, 1, 0, None, "ordered", None, SMALL),
    ("plain 2/2 d64 n2", 2, 2, 64, 2, torch.float32, 1, 0, None, "ordered", None, SMALL),
    ("g2 w1 4/2 d16 n3", 4, 2, 16, 3, torch.float32, 2, 1, None, "ordered", None, SMALL),
    ("sliding 10 ring 4/2 d16", 4, 2, 16, 37, torch.float32, 1, 0, 10, "ring", None, SMALL),
    ("g2 w8 4/2 d16 37", 4, 2, 16, 37, torch.float32, 2, 8, None, "ordered", None, SMALL),
    ("g3 w8 ring 4/1 d64", 4, 1, 64, 45, torch.float32, 3, 8, None, "ring", None, SMALL),
    ("g4 w64 past n 4/2 d16", 4, 2, 16, 37, torch.float32, 4, 64, None, "ordered", None, SMALL),
    ("g4 w16 unused 4/2 d128", 4, 2, 128, 60, torch.float32, 4, 16, None, "unused", None, SMALL),
    ("g4 w8 sliding 20 ring 6/2", 6, 2, 16, 40, torch.float32, 4, 8, 20, "ring", None, SMALL),
    ("g2 w8 partial rotary 32/64", 4, 2, 64, 37, torch.float32, 2, 8, None, "ordered", 32, SMALL),
    ("bf16 plain unused 4/2 d64", 4, 2, 64, 50, torch.bfloat16, 1, 0, None, "unused", None, SMALL),
    ("bf16 g4 w8 4/1 d128", 4, 1, 128, 37, torch.bfloat16, 4, 8, None, "ordered", None, SMALL),
    ("fp16 g2 w8 ring 2/2 d16", 2, 2, 16, 37, torch.float16, 2, 8, None, "ring", None, SMALL),
    ("bf16 g2 w8 16/2 d32", 16, 2, 32, 37, torch.bfloat16, 2, 8, None, "ordered", None, SMALL),
    ("g3 w8 5/1 d16", 5, 1, 16, 37, torch.float32, 3, 8, None, "ordered", None, SMALL),
    ("dispatch g3 w8 unused 4/2", 4, 2, 64, 70, torch.float32, 3, 8, None, "unused", None, None),
    ("dispatch bf16 sliding 12", 4, 2, 16, 33, torch.bfloat16, 1, 0, 12, "ring", None, None),
]


def problem(case: tuple) -> dict[str, object]:
    """Random q/k/v (k/v views of larger buffers, as the cache's), the cells' positions, the query's."""
    name, h, hkv, d, n, dtype, group, window, sliding, layout, rot_dim, tiles = case
    torch.manual_seed(0)
    q = torch.randn(1, h, 1, d).to(dtype)
    k_buf, v_buf = (torch.randn(1, hkv, n + 5, d).to(dtype) for _ in range(2))  # 5 cells of capacity more
    positions = 100 + torch.arange(n)
    last = positions[-1].clone()  # the new token's cell (distance 0)
    in_use = None  # every cell in use
    if layout == "ring":
        positions = positions.roll(n // 3)
    elif layout == "unused":  # the static step's buffers: stale positions after the slots in use
        used = n - n // 3
        last = positions[used - 1].clone()
        positions[used:] = 90 + torch.arange(n - used)  # visible, were they read
        in_use = torch.tensor([used - 1])
    grouped, params = None, None
    if group > 1:
        rot = rot_dim or d
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        params = SimpleNamespace(group_size=group, window=window, inv_freq=inv_freq)
        grouped = GroupedRotations.build(int(last) + 3, params)
    args = (q, k_buf[:, :, :n], v_buf[:, :, :n], positions, last.view(1), d**-0.5, sliding, grouped)
    return {"args": args, "tiles": tiles, "params": params, "in_use": in_use}


# cases run again with the grouped keys stored (as a cache keeps them: rotated, rounded to the cells' type)
STORED = {
    "g2 w8 4/2 d16 37",
    "g3 w8 ring 4/1 d64",
    "g4 w16 unused 4/2 d128",
    "bf16 g4 w8 4/1 d128",
    "fp16 g2 w8 ring 2/2 d16",
    "bf16 g2 w8 16/2 d32",
}


def run(case: tuple, stored: bool = False) -> dict[str, object]:
    """One case: the kernels (directly with the case's tiles, or through ``attend``) against the reference;
    ``stored``: both reading the cells' grouped keys as a cache stores them instead of rotating them."""
    p = problem(case)
    args = p["args"]
    q, k, v, positions, pos, scale, sliding, grouped = args
    kept = None
    if stored:  # the cells' keys at grouped positions, by the cache's own function (cells not in use too)
        kept = grouped_keys(k, positions, p["params"].group_size, p["params"].inv_freq)
    last = p["in_use"]
    want = attend(*args, fused=False, stored=kept, last=last)
    if p["tiles"] is None:
        got = attend(*args, stored=kept, last=last)
    else:
        extra = ()
        if grouped is not None:  # the grouped query as attend makes it
            extra = (grouped.query_at(pos).apply(q.float()), grouped.keys, grouped.window)
        got = fused_decode_attention(
            q, k, v, positions, pos, scale, sliding, *extra, config=p["tiles"], stored=kept, last=last
        )
    assert got.shape == want.shape and got.dtype == torch.float32
    error = ((got - want).abs().max() / want.abs().max()).item()
    name = ("stored " if stored else "") + case[0]
    return {"case": name, "dtype": str(case[5]), "error": error, "tol": TOL}


def static_step(family: str) -> dict[str, object]:
    """Tokens through GraphedDecode's static step (every cell of a 24-cell cache, the kernels taken) against
    the direct step, a tiny model with Self-Extend G=2 W=4, through a context shift (Gemma 3: a sliding
    layer of 8 too): run eagerly, and recorded once and replayed (tests/graph_replay.py: the kernels'
    launches with their grids and arguments as at capture, as a CUDA graph replays them)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import make_model, tiny_gemma3
    from graph_replay import recorded

    from selfextend.generation.generator import Generator
    from selfextend.generation.graphed import GraphedDecode
    from selfextend.hf.patch import apply_self_extend
    from selfextend.kv.cache import ContextShiftCache

    model = tiny_gemma3(["sliding_attention", "full_attention"], 8) if family == "gemma3" else make_model()
    apply_self_extend(model, group_size=2, window=4)
    graphs = []

    def capture(step):
        graph, out = recorded(step)
        graphs.append(graph)
        return graph, out

    logits = []
    for mode in (None, False, capture):  # the direct step; the static one eagerly; recorded and replayed
        gen = Generator(model, ContextShiftCache(model, 24, n_keep=4, dtype=torch.float32))
        if mode is not None:
            gen.fast = GraphedDecode(model, capture=mode, notify=print)
        out = gen.feed(list(range(3, 21)))
        steps = []
        for _ in range(8):
            out = gen.write([int(out.argmax())])
            steps.append(out)
        logits.append((torch.stack(steps), gen.cache.shifts))
    (want, shifts), (eager, _), (replayed, _) = logits
    error = max(((x - want).abs().max() / want.abs().max()).item() for x in (eager, replayed))
    launches = sum(g.launches for g in graphs)
    return {"static_step": family, "error": error, "shifts": shifts, "recorded_launches": launches}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    calls = []
    fused = step_attention.fused_decode_attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return fused(*args, **kwargs)

    step_attention.fused_decode_attention = counted
    for case in CASES:
        print(json.dumps(run(case)), flush=True)
    dispatched = len(calls)
    for case in CASES:
        if case[0] in STORED:
            print(json.dumps(run(case, stored=True)), flush=True)
    print(json.dumps({"dispatched": dispatched}), flush=True)
    for family in ("llama", "gemma3"):
        calls.clear()
        print(json.dumps({**static_step(family), "kernel_calls": len(calls)}), flush=True)


if __name__ == "__main__":
    main()
