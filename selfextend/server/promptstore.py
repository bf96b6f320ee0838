"""Conversations kept in memory when their slot goes to another one (llama-server's ``--cache-ram``).

With more conversations than slots, a slot given to another conversation forgot what it held, and the
first conversation's next request computed its whole prompt again. The store keeps that content instead:
the slot's tokens, history, kept count and a copy of its cells, up to a budget of bytes, the least
recently used out first. A prompt that holds more of a stored conversation than of the slot it was given
gets the stored one copied into that slot (what the slot held is stored in turn), and then reuses it as
the slot's own (:meth:`~selfextend.server.slots.Slot.prepare`). Runs on the engine's thread only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfextend.generation.text import common_prefix
from selfextend.kv.promptcache import snapshot
from selfextend.server.slots import Slot, held


@dataclass
class Stored:
    """A slot's content: the tokens its cells hold, in order, and those cells (per layer, by position)."""

    tokens: list[int]
    history: list[int]
    n_keep: int
    positions: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor | None
    nbytes: int  # of every tensor kept: the cells, their positions, the logits
    last_used: float


class PromptStore:
    """At most ``budget`` bytes of cells of conversations no slot holds; contents under ``min_tokens``
    tokens are not worth a copy."""

    def __init__(self, budget: int, min_tokens: int = 32) -> None:
        self.budget, self.min_tokens = budget, min_tokens
        self.entries: list[Stored] = []
        self.hits = 0  # prompts given a stored conversation
        self.restored = 0  # prompt tokens those held

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def best(self, prompt: Sequence[int]) -> tuple[Stored | None, int]:
        """The stored conversation that holds most of ``prompt`` and how many tokens (None, 0: none)."""
        scored = [(held(e.tokens, e.history, prompt), e) for e in self.entries]
        got, entry = max(scored, key=lambda s: s[0], default=(0, None))
        return (entry, got) if got > 0 else (None, 0)

    def swap(self, slot: Slot, prompt: Sequence[int]) -> None:
        """Before ``slot`` reads ``prompt``: a stored conversation that holds more of it than the slot does
        goes into the slot, and what the slot held is stored; so is what it held where the prompt keeps
        less than half of it (another conversation, not the same one with a changed last reply)."""
        own = slot.score(prompt)
        entry, got = self.best(prompt)
        if entry is None or got <= own:
            if slot.gen is not None and 2 * own < len(slot.gen.tokens):
                self.keep(slot)
            return
        self.entries.remove(entry)  # first: storing the slot's content may drop entries it extends
        self.keep(slot)
        if self._load(entry, slot):
            self.hits += 1
            self.restored += got

    def keep(self, slot: Slot) -> None:
        """Store what ``slot`` holds (unless it is short, or a stored conversation already holds all of it;
        one it extends is replaced), making room by dropping the least recently used."""
        gen = slot.gen
        if gen is None or len(gen.tokens) < self.min_tokens or self.budget <= 0:
            return
        tokens = list(gen.tokens)
        for e in list(self.entries):
            shared = common_prefix(e.tokens, tokens)
            if shared == len(tokens):
                return
            if shared == len(e.tokens):
                self.entries.remove(e)
        positions, keys, values = snapshot(gen.cache, len(tokens))
        logits = None if gen.last_logits is None else gen.last_logits.clone()
        kept = (*positions, *keys, *values, *([] if logits is None else [logits]))
        nbytes = sum(t.numel() * t.element_size() for t in kept)
        if nbytes > self.budget:
            return
        self.entries.sort(key=lambda e: e.last_used)
        while self.entries and self.nbytes + nbytes > self.budget:
            self.entries.pop(0)
        self.entries.append(
            Stored(
                tokens,
                list(slot.history),
                gen.cache.n_keep,
                positions,
                keys,
                values,
                logits,
                nbytes,
                time.monotonic(),
            )
        )

    @staticmethod
    def _load(entry: Stored, slot: Slot) -> bool:
        """``entry`` into ``slot``'s cache; False (the slot left empty) where its cells do not fit it. Any
        other failure midway (a MemoryError while layers are filled) leaves the slot empty too, and is
        raised: never some layers holding the entry's cells while the slot's tokens list its old ones."""
        gen = slot.generator(entry.n_keep)
        try:
            gen.cache.load_prefix(entry.keys, entry.values, len(entry.tokens), entry.positions)
        except ValueError:
            slot.reset()
            return False
        except BaseException:
            slot.reset()
            raise
        gen.tokens, gen.last_logits = list(entry.tokens), entry.logits
        slot.history = list(entry.history)
        return True
