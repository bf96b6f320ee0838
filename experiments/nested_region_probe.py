"""The whole decode step as one compiled graph at one layer's compile cost: a probe, not a product path.

``torch.compiler.nested_compile_region`` around the layer function (:func:`~selfextend.generation.compiled.
layer_rows`) and ``torch.compile`` of the whole :class:`~selfextend.generation.compiled.CompiledStep`: dynamo
traces one layer and stamps it out for the others. Two things in torch 2.13 stand in the way, both worked
around here only: with ``dynamic=True`` stamping out the second layer fails (``InternalTorchDynamoError:
KeyError: 64``), so the step compiles static and marks each layer's cell positions dynamic; and inductor's
lowering of ``_weight_int4pack_mm_for_cpu`` passes the group size as a tensor constant that a subgraph does
not receive as a scalar ("group size must be a scalar"), so ``--fallback`` replaces that lowering with a plain
call of the aten op (a change to torch internals, which is why this is a probe). SmolLM2 int4, f32 cells,
1,400 cells filled; prints the first call's seconds and ms per token over 3 rounds of 100 tokens.

    python experiments/nested_region_probe.py --fallback
"""

from __future__ import annotations

import argparse
import time

import torch
from decode_paths import FILL, filled, load

from selfextend.generation import compiled
from selfextend.generation.cells import StepCells
from selfextend.generation.compiled import FastDecode, no_duck_shapes


def int4_as_fallback() -> None:
    """Inductor calls ``aten._weight_int4pack_mm_for_cpu`` as it is instead of lowering it."""
    from torch._inductor import lowering

    op = torch.ops.aten._weight_int4pack_mm_for_cpu
    for key in (op, op.default):
        lowering.lowerings.pop(key, None)
    lowering.make_fallback(op)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fallback", action="store_true", help="int4 products as plain aten calls")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.fallback:
        int4_as_fallback()
    model = load(args.threads, self_extend=False)
    gen = filled(model, "f32")
    fast = FastDecode(model, compile=False)
    fast.step.layer_fn = torch.compiler.nested_compile_region(compiled.layer_rows)
    fn = torch.compile(fast.step.__call__, dynamic=False)
    cells = StepCells(gen.cache)

    def one() -> torch.Tensor:
        gen.cache.make_room(1)
        c = cells.prepare()
        for positions in c.positions:
            torch._dynamo.mark_dynamic(positions, 0)
        with no_duck_shapes():
            logits = fn(torch.tensor([[5]]), torch.tensor([gen.cache.n_past]), c, fast.grouped_tables(FILL))
        cells.commit()
        return logits

    t0 = time.perf_counter()
    one()
    print(f"first call {time.perf_counter() - t0:.1f} s", flush=True)
    for r in range(3):
        gen.rewind(FILL)
        t0 = time.perf_counter()
        for _ in range(100):
            one()
        print(f"round {r}: {(time.perf_counter() - t0) * 10:.2f} ms per token", flush=True)


if __name__ == "__main__":
    main()
