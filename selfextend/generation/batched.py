"""One token for each of several sequences in one forward: the decode step of continuous batching.

Decoding on a CPU is bound by reading the weights, so B sequences that each need a token share one pass
over them: every projection, the MLP and the output head run on B rows together
(:meth:`~selfextend.generation.compiled.CompiledStep.rows`), and attention runs per sequence over that
sequence's own cache cells (its positions, its Self-Extend grouping, its sliding layers). A sequence the
step does not serve for this token (a model family it does not know, a cache of fewer than two cells, a
layer whose last slot the token would take) is written alone through its generator's own path.

Sequences whose generators share a direct decode step (the CPU's native kernels: every slot of the server)
go through its :meth:`~selfextend.generation.decode.DecodeStep.rows`: the products take their rows together,
the rest is the lone token's code per row, so a row's logits do not depend on the batch where the products
are batch-invariant (the GGUF block products). On a GPU they go through the captured step's
:meth:`~selfextend.generation.graphed.GraphedDecode.rows` first: one graph replay for all the rows (a graph
per set of slots stepped together), where the direct step would launch each row's operations from Python.
The others share the compiled step's rows run eagerly, which pays from about :data:`SHARED_FROM_ON_CPU` of
them on the CPU (a few hundred torch ops per layer;
``python experiments/server/server_decode.py --concurrent 1,2,4,8``); fewer are each written alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from selfextend.generation.cells import Cells, StepCells
from selfextend.generation.compiled import FastDecode, fast_decode_for
from selfextend.generation.generator import Generator
from selfextend.generation.graphed import GraphedDecode

SHARED_FROM_ON_CPU = 6  # sequences from which they share one forward on the CPU (module docstring)


class BatchedDecode:
    """``decode([(generator, token), ...]) -> [logits, ...]``: each token written at its generator's next
    position (shifting its cache first where it is full), the logits (vocab,) after each, in order.

    ``shared_from``: the fewest sequences with direct steps that share a forward (default: 2 on a GPU,
    :data:`SHARED_FROM_ON_CPU` on the CPU).
    """

    def __init__(self, model: nn.Module, shared_from: int | None = None) -> None:
        self.fast: FastDecode | None = fast_decode_for(model, compile=False)  # its step, run eagerly
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.shared_from = shared_from or (SHARED_FROM_ON_CPU if on_cpu else 2)

    def serves(self) -> bool:
        """Whether sequences of this model share a forward (else each is written alone)."""
        return self.fast is not None and self.fast.step.supported()

    @torch.no_grad()
    def __call__(self, pairs: Sequence[tuple[Generator, int]]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(pairs)
        for gen, _ in pairs:
            gen.make_room(1)
        direct = [i for i, (gen, _) in enumerate(pairs) if _direct(gen)]
        if len(direct) > 1 and len({id(pairs[i][0].step.model) for i in direct}) == 1:  # one model's steps
            tokens, caches = [pairs[i][1] for i in direct], [pairs[i][0].cache for i in direct]
            graphed = pairs[direct[0]][0].fast  # on a GPU: every row in one replay of a captured step
            logits = graphed.rows(tokens, caches) if isinstance(graphed, GraphedDecode) else None
            if logits is None:
                logits = pairs[direct[0]][0].step.rows(tokens, caches)
            for i, row in zip(direct, logits, strict=True):
                pairs[i][0].written([pairs[i][1]], row)
                out[i] = row
            rest = [i for i in range(len(pairs)) if out[i] is None]
            for i, row in zip(rest, self._others([pairs[i] for i in rest]), strict=True):
                out[i] = row
            return out
        return self._others(pairs)

    def _others(self, pairs: Sequence[tuple[Generator, int]]) -> list[torch.Tensor]:
        """Sequences without a shared direct step: the compiled step's rows run eagerly where it serves them,
        else each written alone."""
        out: list[torch.Tensor | None] = [None] * len(pairs)
        shared = [self.serves() and gen.cache.n_past >= 2 for gen, _ in pairs]
        if sum(shared) < self.shared_from and all(
            _direct(g) for (g, _), s in zip(pairs, shared, strict=True) if s
        ):
            shared = [False] * len(pairs)  # few enough: each through its own direct step is faster
        rows: list[tuple[int, StepCells, Cells]] = []
        for i, (gen, token) in enumerate(pairs):
            if shared[i]:
                step_cells = StepCells(gen.cache)
                cells = step_cells.prepare()
                if cells is not None:
                    rows.append((i, step_cells, cells))
                    continue
            out[i] = gen.write([token])
        if rows:
            device = rows[0][2].slots.device
            tokens = torch.tensor([[pairs[i][1]] for i, _, _ in rows], device=device)  # (B, 1)
            pos = torch.tensor([pairs[i][0].cache.n_past for i, _, _ in rows], device=device)  # (B,)
            grouped = self.fast.grouped_tables(max(pairs[i][0].cache.n_ctx for i, _, _ in rows))
            logits = self.fast.step.rows(tokens, pos, [cells for _, _, cells in rows], grouped)  # (B, vocab)
            for (i, step_cells, _), row in zip(rows, logits, strict=True):
                step_cells.commit()
                gen, token = pairs[i]
                gen.written([token], row)
                out[i] = row
        return out


def _direct(gen: Generator) -> bool:
    """Whether ``gen`` writes a single token through a direct decode step of its own."""
    return gen.step is not None and gen.step.supported()
