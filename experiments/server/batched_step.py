"""The server's batched decode step and a prompt chunk on a GGUF, in process.

``Engine.batched`` over 1..4 busy slots (each holding a few hundred tokens) and one 64-token chunk written
into a slot, in rounds; prints each setting's best time and every round's. To compare code, run it from
each checkout in turn (``PYTHONPATH=<checkout>``), alternating:

    python experiments/server/batched_step.py -m /work/llama/models/llama-3.2-1b-synthetic-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from selfextend.cli.options import load_with_self_extend
from selfextend.server.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="smollm2-135m")
    parser.add_argument("--parallel", type=int, default=4, help="slots; steps of 1..parallel of them")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_with_self_extend(args.model, "float32", "cpu", None, None, "auto")
    engine = Engine(model, tokenizer, 1024, args.parallel, cache_dtype=torch.float16)
    gens = []
    for i, slot in enumerate(engine.slots):  # fills of 100, 137, 174, ... tokens
        gen = slot.generator(0)
        gen.feed(list(range(1000 + 50 * i, 1100 + 87 * i)))
        gens.append(gen)
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for m in range(1, args.parallel + 1):
            steps = []
            for _ in range(6):
                t0 = time.perf_counter()
                engine.batched([(gen, 1234) for gen in gens[:m]])
                steps.append(time.perf_counter() - t0)
            times.setdefault(f"step, {m} slot(s)", []).append(statistics.median(steps))
        t0 = time.perf_counter()
        gens[0].feed(list(range(2000, 2064)), 512)
        times.setdefault("64-token chunk", []).append(time.perf_counter() - t0)
        for gen in gens:
            gen.cache.truncate(100)
    for name, values in times.items():
        rounds = ", ".join(f"{1e3 * v:.1f}" for v in values)
        print(f"{name:16s} {1e3 * min(values):7.1f} ms (rounds: {rounds})")


if __name__ == "__main__":
    main()
