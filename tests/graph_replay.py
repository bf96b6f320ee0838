"""A CPU stand-in for capturing a CUDA graph: records what a region launches, then replays it.

``torch.cuda.graph`` records the kernels a region launches with their arguments fixed: tensors by address,
every other value (a size, a slice bound, a scalar, a grid) as it was at capture. A replay runs the same
kernels on whatever those addresses hold then. So a captured step that reads a per-token value on the host
(the cache's state as a Python int, a shape that follows the cells in use) is right when run eagerly and
wrong on every replay, and one that reads a device value on the host (``.item()``, ``nonzero``, data
copied from the host) cannot be captured at all. Without a GPU the static step runs eagerly and shows
neither.

:class:`RecordedGraph` records the aten operations a region runs (a ``TorchDispatchMode``) and its Triton
launches (the interpreter's, where ``TRITON_INTERPRET=1``): a tensor made before the region is held as
itself (its memory: the graph's address), one made inside by the operation that made it, and everything
else as it was. :meth:`RecordedGraph.replay` runs them again in order and refreshes the tensors the region
returned, as a replay rewrites a captured graph's outputs in place. Reading a tensor's value on the host
inside the region raises the ``RuntimeError`` a capture raises. :func:`recorded` is a capture function for
:class:`~selfextend.generation.graphed.GraphedDecode` (the one ``cuda_graph`` is on a GPU).

Why not ``torch.fx``/``make_fx``: a traced graph re-derives views and in-place updates through
functionalization, and knows nothing of Triton launches; this replays exactly the calls made, as a graph
replays exactly the kernels launched.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten
# what reads a device tensor's value on the host, or copies host data in: refused while a stream captures
HOST_READS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.lift_fresh.default,
    aten.masked_select.default,
}


# what launches no GPU kernel: views, allocations, a Python scalar wrapped as a tensor
NO_KERNEL = {
    "view", "_unsafe_view", "slice", "select", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand",
    "split", "split_with_sizes", "unbind", "chunk", "alias", "as_strided", "detach", "reshape",
    "empty", "empty_like", "empty_strided", "scalar_tensor", "promote_types",
}  # fmt: skip


class Made(NamedTuple):
    """A tensor made inside the region: output ``out`` (flattened) of recorded call ``call``."""

    call: int
    out: int


class RecordedGraph(TorchDispatchMode):
    """The calls of one region, replayable (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Callable, object, list]] = []  # (function, argument structure, leaves)
        self.made: dict[int, Made] = {}
        self.kept: list[torch.Tensor] = []  # what was made, alive while recording (no id reused)
        self.outputs: list[tuple[torch.Tensor, Made]] = []
        self.launches = 0  # Triton launches recorded

    def _leaves(self, args: tuple, kwargs: dict) -> tuple[object, list]:
        leaves, spec = tree_flatten((args, kwargs))
        return spec, [self.made.get(id(x), x) if isinstance(x, torch.Tensor) else x for x in leaves]

    def _note_made(self, out: object, inputs: list) -> None:
        seen = {id(x) for x in inputs if isinstance(x, torch.Tensor)}
        for j, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor) and id(t) not in self.made and id(t) not in seen:
                self.made[id(t)] = Made(len(self.calls) - 1, j)
                self.kept.append(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise RuntimeError(f"operation not permitted when stream is capturing ({func})")
        spec, leaves = self._leaves(args, kwargs)
        self.calls.append((func, spec, leaves))
        out = func(*args, **kwargs)
        self._note_made(out, tree_flatten((args, kwargs))[0])
        return out

    def launch(self, run: Callable, fn: object, args: tuple, kwargs: dict) -> object:
        """A Triton launch inside the region: recorded, then run with the recording paused (the
        interpreter's own copies to and from its host arrays are not the kernel's calls)."""
        spec, leaves = self._leaves(args, kwargs)
        self.calls.append((lambda *a, **k: run(fn, *a, **k), spec, leaves))
        self.launches += 1
        with _disable_current_modes():
            return run(fn, *args, **kwargs)

    def kernels(self) -> list[str]:
        """The recorded calls that launch work on a GPU, in order: aten operations by name (those of
        :data:`NO_KERNEL` left out) and ``triton`` for each Triton launch."""
        names = [getattr(func, "__name__", "") for func, _, _ in self.calls]
        names = ["triton" if name == "<lambda>" else name.split(".")[0] for name in names]
        return [name for name in names if name not in NO_KERNEL]

    def record(self, region: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``region`` once, recording it; its result is refreshed by each :meth:`replay`."""
        with self, _launches_recorded(self):
            out = region()
        self.outputs = [(t, self.made[id(t)]) for t in tree_flatten(out)[0] if id(t) in self.made]
        self.made, self.kept = {}, []
        return out

    def replay(self) -> None:
        """The recorded calls again, on the tensors they were given (those made inside made anew)."""
        values: dict[Made, object] = {}
        for i, (func, spec, leaves) in enumerate(self.calls):
            args, kwargs = tree_unflatten([values[x] if isinstance(x, Made) else x for x in leaves], spec)
            for j, t in enumerate(tree_flatten(func(*args, **kwargs))[0]):
                values[Made(i, j)] = t
        for t, made in self.outputs:
            t.copy_(values[made])


@contextmanager
def _launches_recorded(graph: RecordedGraph):
    """While recording: Triton's interpreted launches go through :meth:`RecordedGraph.launch` (nothing
    where triton is not imported or not interpreting)."""
    import sys

    interpreter = sys.modules.get("triton.runtime.interpreter")
    kind = getattr(interpreter, "InterpretedFunction", None)
    if kind is None:
        yield
        return
    run = kind.run

    def launched(fn, *args, **kwargs):
        return graph.launch(run, fn, args, kwargs)

    kind.run = launched
    try:
        yield
    finally:
        kind.run = run


def recorded(run: Callable[[], torch.Tensor]) -> tuple[RecordedGraph, torch.Tensor]:
    """A capture function for GraphedDecode on the CPU: ``run`` twice (the warm-up), then recorded."""
    for _ in range(2):
        run()
    graph = RecordedGraph()
    return graph, graph.record(run)
