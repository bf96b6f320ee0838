"""Slots: one context-shift cache each, and how a new prompt reuses what a slot's cache already holds.

A prompt reuses, in this order:

- the continuation of the slot's history: the cache went through context shifts while it read the last
  prompt and reply, and the new prompt starts with all of them (a client that sends the whole growing
  conversation). Nothing is recomputed; the cache goes on shifting as ``selfextend chat`` does;
- else the common prefix of the cached tokens and the prompt, and then, with ``cache_reuse = M > 0``,
  chunks of at least M cached tokens that reappear further on in the prompt (a client cut old messages
  from the front): the cells before such a chunk are removed and the chunk moved down to where the
  prompt has it, keys re-rotated (K-shift), as llama-server's ``--cache-reuse`` does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from selfextend.generation.backends import DecodeBackends
from selfextend.generation.generator import Generator
from selfextend.generation.settings import CACHE_DTYPES
from selfextend.generation.speculative import Drafter
from selfextend.generation.text import common_prefix
from selfextend.kv.cache import ContextShiftCache
from selfextend.kv.sliding import SlidingShiftLayer


@dataclass
class Reuse:
    """What a prompt took from a slot's cache instead of recomputing it."""

    prefix: int = 0  # tokens of the common prefix (or of the history the prompt continues)
    moved: int = 0  # tokens of chunks moved by K-shift
    chunks: int = 0  # how many chunks were moved

    @property
    def tokens(self) -> int:
        return self.prefix + self.moved


def _match(a: Sequence[int], i: int, b: Sequence[int], j: int) -> int:
    """How many tokens ``a[i:]`` and ``b[j:]`` share at their start."""
    n = 0
    while i + n < len(a) and j + n < len(b) and a[i + n] == b[j + n]:
        n += 1
    return n


def reuse_chunks(gen: Generator, prompt: Sequence[int], start: int, min_chunk: int) -> tuple[int, int]:
    """Move chunks of at least ``min_chunk`` cached tokens after ``start`` to where ``prompt`` has them.

    ``gen.tokens[:start] == prompt[:start]``. Scans the cache from ``start`` for a run of at least
    ``min_chunk`` tokens equal to the prompt's next ones; removes the cells before it and moves the rest
    down (keys re-rotated), then goes on after it. Returns (tokens now matching, chunks moved); the cells
    after the matching ones are left for the caller to drop.
    """
    cache, tokens = gen.cache, gen.tokens
    i, chunks = start, 0
    while i < len(tokens) and i < len(prompt):
        c = next((c for c in range(i, len(tokens)) if _match(tokens, c, prompt, i) >= min_chunk), None)
        if c is None:
            break
        n = _match(tokens, c, prompt, i)
        if c > i:
            end = len(tokens)
            cache.remove(i, c)
            cache.move(c, end, i - c)
            del tokens[i:c]
            chunks += 1
        i += n
    return i, chunks


def held(tokens: Sequence[int], history: Sequence[int], prompt: Sequence[int]) -> int:
    """Prompt tokens a cache holding ``tokens`` (after ``history``, its tokens before context shifts) keeps at
    their place: the history's length if the prompt continues a history the shifts cut, else the common
    prefix of ``tokens`` and the prompt."""
    n = len(history)
    if n > len(tokens) and list(prompt[:n]) == list(history):
        return n
    return common_prefix(tokens, prompt)


def can_move(cache: ContextShiftCache) -> bool:
    """Whether chunks can be moved in this cache (sliding-window layers keep their own window layout)."""
    return not any(isinstance(layer, SlidingShiftLayer) for layer in cache.layers)


@dataclass
class Slot:
    """One cache, its generator and the token history that produced the cache's contents.

    ``history``: every token written since the cache was last cut back (the prompt and reply of the
    requests it served), including those the context shifts have since removed.
    """

    id: int
    model: nn.Module
    n_ctx: int
    backends: DecodeBackends | None = None  # the decode steps all slots share (the int8 weights fused once,
    # on a GPU one captured step whose graphs are kept per set of slots); None: every token by the forward
    cache_dtype: torch.dtype | None = None  # the cells' element type (None: the model's)
    draft: Drafter | None = None  # the slot's own draft model state (generation.draft), None: lookup or none
    gen: Generator | None = None
    history: list[int] = field(default_factory=list)
    last_used: float = 0.0
    busy: bool = False

    def _build(self, n_keep: int) -> Generator:
        cache = ContextShiftCache(self.model, n_ctx=self.n_ctx, n_keep=n_keep, dtype=self.cache_dtype)
        shared = self.backends is not None
        gen = Generator(self.model, cache, direct_decode=shared, backends=self.backends, draft=self.draft)
        self.history = []
        return gen

    def generator(self, n_keep: int) -> Generator:
        """The slot's generator with ``n_keep`` cells kept at every shift (a fresh cache only where a
        sliding-window layer's layout depends on it)."""
        if self.gen is None or (self.gen.cache.n_keep != n_keep and not can_move(self.gen.cache)):
            self.gen = self._build(n_keep)
        self.gen.cache.n_keep = n_keep
        return self.gen

    def cache_type(self) -> str:
        """The cells' element type by its ``--cache-type`` name (llama.cpp's: f32, bf16, f16)."""
        model_dtype = next(self.model.parameters()).dtype
        dtype = self.gen.cache.layers[0].keys.dtype if self.gen else self.cache_dtype or model_dtype
        return {v: k for k, v in CACHE_DTYPES.items()}.get(dtype, str(dtype).removeprefix("torch."))

    def continues(self, prompt: Sequence[int]) -> bool:
        """Whether ``prompt`` continues the history of a cache that has shifted."""
        gen = self.gen
        n = len(self.history)
        return gen is not None and n > len(gen.tokens) and list(prompt[:n]) == self.history

    def score(self, prompt: Sequence[int]) -> int:
        """Prompt tokens this slot holds at their place: its history's length if the prompt continues it,
        else the common prefix of its cache and the prompt."""
        return 0 if self.gen is None else held(self.gen.tokens, self.history, prompt)

    def prepare(self, prompt: Sequence[int], n_keep: int, min_chunk: int = 0, reuse: bool = True) -> Reuse:
        """Make the cache hold the longest reusable start of ``prompt``; returns what was reused.

        ``min_chunk``: the cache-reuse chunk size (0: the common prefix only); ``reuse=False``: nothing,
        the whole prompt is computed again.
        """
        if not reuse:
            self.generator(n_keep).rewind(0)
            self.history = []
            return Reuse()
        if self.continues(prompt):
            self.generator(n_keep)
            return Reuse(prefix=len(self.history))
        gen = self.generator(n_keep)
        took = Reuse(prefix=common_prefix(gen.tokens, prompt))
        end = took.prefix
        if min_chunk > 0 and can_move(gen.cache) and end < min(len(gen.tokens), len(prompt)):
            end, took.chunks = reuse_chunks(gen, prompt, end, min_chunk)
            took.moved = end - took.prefix
        if end < len(gen.tokens):
            gen.rewind(end)
        self.history = list(gen.tokens)
        return took

    def finish(self, prompt: Sequence[int], fed: Sequence[int], complete: bool) -> None:
        """Record what the cache was given: ``prompt`` then the generated tokens ``fed`` to it. A request
        cut off during its prompt (``complete`` False) leaves only the cached tokens as history."""
        if self.gen is None:
            return
        self.history = [*prompt, *fed] if complete else list(self.gen.tokens)
        self.last_used = time.monotonic()

    def reset(self) -> None:
        """Forget everything cached: every layer empty, whatever state a failed step or load left it in."""
        if self.gen is not None:
            self.gen.cache.reset()
            self.gen.tokens, self.gen.last_logits = [], None
        self.history = []

    def recover(self) -> None:
        """After a step that failed midway: every layer back to the tokens the generator recorded as written
        (a layer may have taken a cell for the token it was computing, or a shift have stopped halfway),
        or, where that cannot be exact, :meth:`reset`. The next prompt then reuses only what is right."""
        gen = self.gen
        if gen is None:
            return
        n, cache = len(gen.tokens), gen.cache
        if cache.can_truncate(n):
            cache.truncate(n)
            if all(layer.next_pos == n and layer.max_position() == n - 1 for layer in cache.layers):
                return
        self.reset()


def pick(slots: Sequence[Slot], prompt: Sequence[int], wanted: int | None = None) -> Slot | None:
    """The free slot that holds most of ``prompt`` (least recently used among equals), or slot ``wanted``
    if it is free; None when none is."""
    free = [s for s in slots if not s.busy and (wanted is None or s.id == wanted)]
    if not free:
        return None
    return max(free, key=lambda s: (s.score(prompt), -s.last_used))
