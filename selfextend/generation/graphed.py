"""The decode step with static shapes, captured once as a CUDA graph and replayed for every token.

A step of an 8B model launches about a thousand small kernels; on a GPU, launching them from Python costs
more than the arithmetic (issue 48 measured 67 ms a token through transformers' forward on an H200 where
reading the weights takes 3.4 ms). :class:`GraphedDecode` runs the compiled step's layer
(:func:`~selfextend.generation.layer.layer_rows`: the one description of the step's math that the
compiled and batched paths run) over each layer's whole buffers, the cells in use being the slots up to
the new token's (attention reads no further, whatever the later slots hold), so every token has the same
shapes. Per token the host writes one int64 row (the token, its position, each layer's slot) into a
buffer the graph reads; the new cells' positions are written inside the graph (by the layers, with the
keys and values).
Context shifts edit the same buffers in place (their addresses never change), so a graph stays valid
through them; Self-Extend's rotation tables are built once for the cache's size.

The graph is captured once per cache and attention setting (a new cache, or Self-Extend applied or
removed, captures again). Capturing runs the token's step twice first (warm-up): each run writes the same
key and value into the same cells, so the cache ends as one step leaves it. Where capture fails (a
kernel that syncs, an old driver) the same static step runs eagerly, said once. On the CPU it runs eagerly
unless given a capture function: the tests hold its math to :class:`DecodeStep`'s eagerly and through
``tests/graph_replay.py``, which records and replays the step as a graph would (values read on the host
baked in).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple, Protocol

import torch
from torch import nn

from selfextend.core.fused_prefill import on_device
from selfextend.generation.cells import Cells
from selfextend.generation.compiled import FastDecode, _stderr, frequencies
from selfextend.generation.rotary import static_rope
from selfextend.generation.step_attention import GroupedRotations
from selfextend.kv.cache import ContextShiftCache
from selfextend.kv.sliding import SlidingShiftLayer

GRAPHS_PER_CACHE = 8  # graphs a cache holds, one per set of caches it was stepped with (oldest dropped)


class Replayable(Protocol):
    """A captured step: ``replay()`` runs it again on the memory it was captured with."""

    def replay(self) -> None: ...


Capture = Callable[[Callable[[], torch.Tensor]], tuple[Replayable, torch.Tensor]]


def cuda_graph(run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``run`` captured as a CUDA graph, after two warm-up runs on a side stream (what capturing asks:
    allocations and lazy initialization done before), with its result, which each replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


class _Captured(NamedTuple):
    """One cache's graph: the int64 row it reads (token, position, a slot per layer) and its logits."""

    key: tuple
    io: torch.Tensor
    graph: Replayable | None
    logits: torch.Tensor | None


class GraphedDecode(FastDecode):
    """``graphed(token, cache) -> logits | None``: one token at ``cache.n_past`` through the static step,
    replayed from a CUDA graph (``capture``, on a GPU) or run eagerly. None where it does not serve the token
    (fewer than two cells, a layer's last free slot, an attention it does not compute): the caller then
    takes another path, as with :class:`~selfextend.generation.compiled.FastDecode`."""

    def __init__(
        self,
        model: nn.Module,
        capture: Capture | Literal[False] | None = None,
        notify: Callable[[str], None] = _stderr,
    ) -> None:
        """``capture``: what records the step (:func:`cuda_graph` on a GPU by default, never on the CPU;
        a test's stand-in records it anywhere); ``capture=False`` runs every token eagerly."""
        super().__init__(model, compile=False, notify=notify)
        self.capture = capture
        self.held: weakref.WeakKeyDictionary[ContextShiftCache, dict[tuple[int, ...], _Captured]] = (
            weakref.WeakKeyDictionary()
        )

    @staticmethod
    def _slots(cache: ContextShiftCache) -> list[int] | None:
        """Each layer's slot for the next token (a full sliding ring compacted first), or None where a layer
        has only its last slot left (the step's rule, as :class:`~selfextend.generation.cells.StepCells`)."""
        slots = []
        for layer in cache.layers:
            if isinstance(layer, SlidingShiftLayer) and layer.n_used + 1 >= layer.capacity:
                layer.compact()
            if layer.n_used + 1 >= layer.capacity:
                return None
            slots.append(layer.n_used)
        return slots

    def _stored(self, cache: ContextShiftCache, grouped: list[GroupedRotations | None], params: list) -> list:
        """Per layer the cache's keys at Self-Extend's grouped positions (a full layer's
        :class:`~selfextend.kv.grouped.GroupedKeys` buffer), made current for the cells in use (rotated here,
        eagerly, only where cells changed since: after a prompt, a context shift), or None (no grouping, a
        sliding layer: the step rotates them). The step reads them instead of rotating every grouped key
        each token, and writes the new cell's (``layer_rows``)."""
        out = []
        for layer, table, p, inv_freq in zip(cache.layers, grouped, params, frequencies(params), strict=True):
            if table is None or p is None or isinstance(layer, SlidingShiftLayer):
                out.append(None)
                continue
            g, n = p.group_size, layer.n_used
            if (
                layer.grouped.held(layer.keys, n, g, inv_freq) is None
            ):  # (a few attribute reads where current)
                layer.grouped.get(layer.keys, layer.positions, g, inv_freq, n)
            out.append(layer.grouped.buf)
        return out

    def _run(
        self,
        io: torch.Tensor,
        caches: Sequence[ContextShiftCache],
        grouped: list[GroupedRotations | None],
        stored: list[list],
    ):
        """The static step: logits (B, vocab) after the tokens of ``io`` = [B tokens, B positions, then each
        cache's slot per layer] (int64, on the caches' device), each row's key and value written into every
        layer of its cache (and its grouped key where ``stored[b]`` holds a layer's)."""
        b = len(caches)
        tokens, pos, slots = io[:b].view(b, 1), io[b : 2 * b], io[2 * b :].view(b, -1)  # slots: (B, layers)
        cells = []
        for j, cache in enumerate(caches):
            layers = cache.layers
            keys, values = [x.keys for x in layers], [x.values for x in layers]
            # every slot's position, those after the new token's stale: attention reads up to its slot
            cells.append(Cells(keys, values, [x.positions for x in layers], slots[j], stored[j]))
        return self.step.rows(tokens, pos, cells, grouped)

    def _key(self, caches: Sequence[ContextShiftCache], grouped: list, stored: list[list]) -> tuple:
        """What a captured graph holds fixed: the caches' buffers (keys, values, positions; the grouped
        keys' too) by address and shape, the attention and Self-Extend's tables. (Every buffer the graph
        reads: a slot's cache made again may get its old keys' addresses back from the allocator, and
        another cache its Python id.)"""
        buffers = tuple(
            (t.data_ptr(), t.shape)
            for cache in caches
            for layer in cache.layers
            for t in (layer.keys, layer.values, layer.positions)
        )
        kept = tuple(None if t is None else t.data_ptr() for row in stored for t in row)
        tables = tuple(None if g is None else (g.window, g.keys.cos.data_ptr()) for g in grouped)
        return buffers, kept, tables, self.step.config._attn_implementation

    def _captured(
        self,
        caches: Sequence[ContextShiftCache],
        io: torch.Tensor,
        device: torch.device,
        grouped: list,
        stored: list[list],
    ) -> _Captured:
        """The caches' graph, captured now where there is none for its current key (``io``, on the host,
        holds these tokens: the warm-up runs are their step; copied to ``device`` only for a new graph).
        Held by the first cache, for each set of others (at most :data:`GRAPHS_PER_CACHE`: a server's slots
        come and go in any combination)."""
        key = self._key(caches, grouped, stored)
        others = tuple(id(c) for c in caches[1:])
        found = self.held.setdefault(caches[0], {})
        held = found.get(others)
        if held is not None and held.key == key:
            return held
        capture = self.capture
        if capture is None:
            capture = cuda_graph if device.type == "cuda" else False
        static = io.to(device, copy=True)  # the row the graph reads (copied over only when one is made)
        held = _Captured(key, static, None, None)
        if capture:
            try:  # the warm-up runs are this step: each writes the same cells; on the caches' GPU (made
                # current: a capture records the current device's stream, and cuda:1's kernels would run
                # eagerly past a capture on cuda:0's, leaving an empty graph)
                with on_device(device):
                    graph, logits = capture(lambda: self._run(static, caches, grouped, stored))
                held = _Captured(key, static, graph, logits)
            except RuntimeError as e:  # a kernel that cannot be captured: the same step, eagerly
                self.capture = False
                said = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.notify(
                    f"warning: the decode step was not captured as a CUDA graph, run eagerly ({said})"
                )
        found.pop(others, None)
        if len(found) >= GRAPHS_PER_CACHE:
            found.pop(next(iter(found)))  # the oldest
        found[others] = held
        return held

    @torch.no_grad()
    def __call__(self, token: int, cache: ContextShiftCache) -> torch.Tensor | None:
        """Logits (vocab,) after ``token`` written at ``cache.n_past`` (room made first), or None."""
        out = self.rows([token], [cache])
        return None if out is None else out[0]

    @torch.no_grad()
    def rows(self, tokens: Sequence[int], caches: Sequence[ContextShiftCache]) -> torch.Tensor | None:
        """Logits (B, vocab): row ``b`` after ``tokens[b]`` written at ``caches[b].n_past`` (room made first;
        one row a cache), every row in one replay (the weights read once for all: a server's slots); None
        where the step does not serve one of them (the caller then takes another path for all)."""
        if len({id(c) for c in caches}) < len(caches) or not self.step.supported():
            return None
        slots = []
        for cache in caches:
            found = self._slots(cache) if cache.n_past >= 2 else None
            if found is None:
                return None
            slots += found
        device = caches[0].layers[0].keys.device
        io = torch.tensor([*tokens, *(c.n_past for c in caches), *slots], dtype=torch.long)
        params = self.step.self_extend()  # (read once a token: the host's time is the token's too)
        grouped = self.grouped_tables(max(c.n_ctx for c in caches), params)
        stored = [self._stored(cache, grouped, params) for cache in caches]
        held = self._captured(caches, io, device, grouped, stored)
        held.io.copy_(io, non_blocking=True)
        if held.graph is not None:
            with on_device(device):  # (a graph replays on the current device's stream)
                held.graph.replay()
            logits = held.logits.clone()
        else:
            logits = self._run(held.io, caches, grouped, stored)
        for cache, kept_by_layer in zip(caches, stored, strict=True):
            for layer, kept in zip(cache.layers, kept_by_layer, strict=True):
                if kept is None:
                    layer.grouped.invalidate(layer.n_used)
                else:  # the step wrote the new cell's grouped key: slots [0, n_used] are current
                    layer.grouped.valid = layer.n_used + 1
                layer.n_used += 1
                layer.next_pos += 1
        return logits


def graphed_serves(model: nn.Module) -> bool:
    """Whether the static step serves ``model``: on a GPU, of the compiled step's families, with RoPE whose
    factors depend on the position alone (asked without building the step)."""
    from selfextend.generation.decode import why_not

    if next(model.parameters()).device.type != "cuda" or why_not(model) is not None:
        return False
    return static_rope(model.model.rotary_emb)


def graphed_decode_for(model: nn.Module) -> GraphedDecode | None:
    """The static step for ``model`` where :func:`graphed_serves`, else None."""
    return GraphedDecode(model) if graphed_serves(model) else None
