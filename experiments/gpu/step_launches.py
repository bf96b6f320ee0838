"""Kernels the captured decode step launches a token, counted without a GPU.

``tests/graph_replay.py`` records the step as a CUDA graph records it (every aten operation and Triton
launch), with ``TRITON_INTERPRET=1`` the fused kernels run on the CPU; this counts the recorded calls that
launch GPU work (views and allocations left out) for a Llama-3.1-8B-shaped stack of 32 layers (GQA 32/8;
widths shrunk, which changes no count), plain and Self-Extend, with the fused step kernels of
``selfextend/core/fused_step.py`` and without them (the layer's torch operations). In a graph a launch
still costs the GPU a few microseconds however small its work: at 32 layers the count, not the
arithmetic, is what stands between a token and the weights' read.

    TRITON_INTERPRET=1 PYTHONPATH=. python experiments/gpu/step_launches.py
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from graph_replay import recorded  # noqa: E402

import selfextend.generation.layer as layer_module  # noqa: E402
from selfextend.generation.generator import Generator  # noqa: E402
from selfextend.generation.graphed import GraphedDecode  # noqa: E402
from selfextend.hf.patch import apply_self_extend  # noqa: E402
from selfextend.kv.cache import ContextShiftCache  # noqa: E402

LAYERS = 32
SHAPE = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=LAYERS,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)


def launches(self_extend: bool, fused: bool) -> list[str]:
    """The launching calls of one captured token (bf16 weights and cells)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation="sdpa")).to(torch.bfloat16).eval()
    if self_extend:
        apply_self_extend(model, group_size=4, window=16)
    graphs = []

    def capture(run):
        graphs.append(recorded(run))
        return graphs[-1]

    applies = layer_module.fused_step_applies
    layer_module.fused_step_applies = applies if fused else (lambda x: False)
    try:
        gen = Generator(model, ContextShiftCache(model, 64, n_keep=4, dtype=torch.bfloat16))
        gen.fast = GraphedDecode(model, capture=capture, notify=print)
        gen.feed(list(range(3, 40)))
        gen.write([5])
    finally:
        layer_module.fused_step_applies = applies
    return graphs[0][0].kernels()


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the fused kernels on the CPU)")
    print(f"| step ({LAYERS} layers, bf16) | kernels a token | a layer | of them Triton | most launched |")
    print("|---|---|---|---|---|")
    for self_extend in (False, True):
        for fused in (False, True):
            names = launches(self_extend, fused)
            common = ", ".join(f"{n} {c}" for n, c in collections.Counter(names).most_common(4))
            label = ("Self-Extend" if self_extend else "plain") + (
                ", fused step kernels" if fused else ", torch ops"
            )
            print(
                f"| {label} | {len(names)} | {len(names) / LAYERS:.1f} | {names.count('triton')} | {common} |"
            )


if __name__ == "__main__":
    main()
