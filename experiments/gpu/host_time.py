"""The host's time a decode token costs around the captured step's replay, measured on the CPU.

On a GPU a token's sampling waits for its replay (the chosen id is read on the host), and the Python that
prepares the next token (each layer's slot, Self-Extend's tables and grouped keys, the graph's lookup,
the sampler) runs while the GPU idles: it adds to every token, and what Self-Extend adds to it adds to
its ratio against plain decode (issue 48: within 1.1x). Here the replay is a no-op (the step captured by a
stand-in that runs it once), so that Python alone is timed, per token: through ``GraphedDecode.rows``, and
through the generator's greedy decode loop around it; plain and Self-Extend, rounds interleaved, on a
32-layer stack (the 8B shape's layer count; the widths change none of the host's work).

    PYTHONPATH=. python experiments/gpu/host_time.py [--tokens 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from selfextend.generation.generator import Generator
from selfextend.generation.graphed import GraphedDecode
from selfextend.generation.sampling import SamplingParams
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache

SHAPE = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)


class NoReplay:
    """A captured step whose replay does nothing (the GPU's part, not timed here)."""

    def replay(self) -> None:
        pass


def captured_once(run):
    """The stand-in capture: the step run once (its logits kept), every replay a no-op."""
    return NoReplay(), run()


def setup(self_extend: bool, n_ctx: int) -> tuple[Generator, GraphedDecode, torch.Tensor]:
    """A generator over a fresh cache with the no-op captured step, a prompt written."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    if self_extend:
        apply_self_extend(model, group_size=4, window=16)
    gen = Generator(model, ContextShiftCache(model, n_ctx, n_keep=4), SamplingParams(temperature=0))
    gen.fast = graphed = GraphedDecode(model, capture=captured_once, notify=print)
    return gen, graphed, gen.feed(list(range(3, 40)))


def per_token(self_extend: bool, tokens: int) -> tuple[float, float]:
    """Milliseconds a token: ``rows`` alone, then the decode loop (sampling, writing, the step's Python)."""
    gen, graphed, logits = setup(self_extend, 2 * tokens + 64)
    graphed(5, gen.cache)  # the capture
    start = time.perf_counter()
    for _ in range(tokens):
        graphed(5, gen.cache)
    rows = (time.perf_counter() - start) / tokens * 1e3
    loop = gen.decode(logits, tokens)
    start = time.perf_counter()
    for _ in loop:
        pass
    return rows, (time.perf_counter() - start) / tokens * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    found: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.rounds):  # interleaved: plain, Self-Extend, plain, ...
        for self_extend in (False, True):
            found[self_extend].append(per_token(self_extend, args.tokens))
    print(f"host ms a token, {SHAPE['num_hidden_layers']} layers, median of {args.rounds} rounds:")
    for self_extend, runs in found.items():
        rows, loop = (statistics.median(r[i] for r in runs) for i in (0, 1))
        label = "Self-Extend G=4 W=16" if self_extend else "plain"
        print(f"  {label:22} GraphedDecode.rows {rows:.3f} ms, the decode loop (rows in it) {loop:.3f} ms")


if __name__ == "__main__":
    main()
