"""llama.cpp as a yardstick: greedy decoding with llama.cpp's own context shift, through llama-cpp-python.

Optional (never a dependency): ``selfextend bench`` uses it, when installed, to time llama.cpp on the
same GGUF file as our generation loop, in the same process and run. The shift is llama.cpp's:
``n_discard = (n_past - n_keep) // 2``, remove those cells, move the rest down by ``n_discard``
(llama.cpp re-rotates the keys itself).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np

from selfextend.kv.cache import discard_count


def gguf_weight_bytes(gguf: str | Path) -> int:
    """Bytes of weights one llama.cpp decode step reads from ``gguf``: every tensor as stored, of a token
    embedding with a separate output head one row."""
    from selfextend.models.gguf import GGUFTable

    tensors = {t.name: t for t in GGUFTable.read(gguf).tensors}
    total = sum(int(np.prod(t.raw_shape)) * t.raw_dtype.itemsize for t in tensors.values())
    embed = tensors.get("token_embd.weight")
    if embed is not None and "output.weight" in tensors:
        total -= (embed.raw_shape[0] - 1) * int(np.prod(embed.raw_shape[1:])) * embed.raw_dtype.itemsize
    return total


def available() -> bool:
    """Whether llama-cpp-python is installed."""
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppGenerator:
    """One llama.cpp context of ``n_ctx`` cells on ``gguf``, decoding greedily with context shifts."""

    def __init__(self, gguf: str | Path, n_ctx: int, n_keep: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=min(512, n_ctx),
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.n_ctx, self.n_keep = n_ctx, n_keep
        self.n_vocab = self.llm.n_vocab()
        self.shifts = 0

    def _last_logits(self) -> np.ndarray:
        """The logits of the last token evaluated (llama.cpp keeps only those without logits_all)."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits(self.llm.ctx), shape=(self.n_vocab,))

    def _shift(self) -> None:
        llm, lib = self.llm, self.lib
        n_past = llm.n_tokens
        n_discard = discard_count(n_past, self.n_keep)
        memory = lib.llama_get_memory(llm.ctx)
        lib.llama_memory_seq_rm(memory, 0, self.n_keep, self.n_keep + n_discard)
        lib.llama_memory_seq_add(memory, 0, self.n_keep + n_discard, n_past, -n_discard)
        kept = llm.input_ids[self.n_keep + n_discard : n_past].copy()
        llm.input_ids[self.n_keep : n_past - n_discard] = kept
        llm.n_tokens = n_past - n_discard
        self.shifts += 1

    def tokens_per_second(self, prompt: list[int], n_tokens: int) -> float:
        """Evaluate ``prompt`` in a fresh context, then time ``n_tokens`` greedy decode steps."""
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for _ in range(n_tokens):
            token = int(self._last_logits().argmax())
            if llm.n_tokens + 1 > self.n_ctx:
                self._shift()
            llm.eval([token])
        return n_tokens / (time.perf_counter() - t0)

    def first_token_seconds(self, prompt: list[int]) -> float:
        """Seconds from a fresh context to the first generated token: ``prompt`` evaluated, one argmax."""
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        int(self._last_logits().argmax())
        return time.perf_counter() - t0
