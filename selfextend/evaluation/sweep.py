"""Perplexity against length: documents x methods x lengths, one JSONL record per finished point.

Rerunning with the same output file skips the points already there. For methods where a
token's score does not depend on what follows it (all but dynamic NTK), one forward over the
longest missing length scores every shorter prefix too, so the sweep costs one long forward
per (document, method).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from selfextend.evaluation.corpus import CorpusError
from selfextend.evaluation.distributed import forward_cost
from selfextend.evaluation.lengths import check_lengths
from selfextend.evaluation.methods import Method, applied, unique_methods
from selfextend.evaluation.nll import dense_sliding_mask, segment_ppl, shift_nll, token_nll
from selfextend.evaluation.results import append_jsonl, own_records, repair_tail


def dtype_name(model_or_dtype: nn.Module | torch.dtype | str) -> str:
    """A dtype as records spell it (``float32``, ``bfloat16``...): a model's parameter dtype, a torch dtype,
    or a ``--dtype`` value (aliases such as ``fp32`` normalised; ``auto`` stays ``auto``)."""
    if isinstance(model_or_dtype, nn.Module):
        model_or_dtype = next(model_or_dtype.parameters()).dtype
    if isinstance(model_or_dtype, str):
        from selfextend.models import parse_dtype

        model_or_dtype = parse_dtype(model_or_dtype)
    return str(model_or_dtype).removeprefix("torch.")


def tokenize_prefix(tokenizer, text: str, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` tokens of ``text`` (1, n) or fewer if it is shorter; tokenizes only a prefix."""
    chars = n_tokens * 8
    while True:
        ids = tokenizer(text[:chars], return_tensors="pt").input_ids
        if ids.shape[1] >= n_tokens or chars >= len(text):
            return ids[:, :n_tokens]
        chars *= 2


SCORING_CHUNK = 4096
"""Tokens per forward when a model with sliding layers is scored by chunked prefill (see
``nll.dense_sliding_mask``): larger than generation's ``PREFILL_CHUNK``, since scoring shows no progress
per piece and fewer, larger pieces run faster."""


@torch.no_grad()
def score(model: nn.Module, ids: torch.Tensor, method: Method) -> torch.Tensor:
    """Per-token NLL of ``ids`` under ``method``."""
    with applied(model, method):
        if method.kind == "shift":
            return shift_nll(model, ids, int(method.params["ctx"]), int(method.params.get("keep", 0)))
        # Dynamic NTK rescales by the length seen so far, so a chunked prefill would change its numbers.
        chunked = method.kind != "ntk" and dense_sliding_mask(model)
        return token_nll(model, ids, prefill_chunk=SCORING_CHUNK if chunked else None)


@dataclass
class Run:
    """One forward (or stream) of ``length`` tokens of ``doc`` under ``method``, scoring ``covers``."""

    doc: str
    method: Method
    length: int
    covers: list[int]
    text: str | None = None  # the document's text_id


def text_id(text: str) -> str:
    """A document's text in a record (16 hex digits of its sha256): two texts under one name (a file of
    the same stem elsewhere, another dataset's ``train-0``) are different points."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


LEGACY = {"dtype": "float32"}
"""Records written before ``dtype`` was recorded were all float32 (the only dtype the scripts used)."""


def point_key(record: dict) -> tuple:
    """What identifies a perplexity point: a resumed or merged sweep holds each key once.

    Everything that changes the numbers: model (with its weight format), dtype, the document (its name
    and its text's :func:`text_id`), method, length. A record missing a field gets None there, so it never
    stands in for a real point (records from before ``text`` was written are measured again).
    """
    fields = ("model", "dtype", "doc", "text", "method", "length")
    return tuple(record.get(f, LEGACY.get(f)) for f in fields)


def run_cost(run: Run, hidden_size: int) -> float:
    """Relative compute of ``run``, for sharing runs among processes (a shift streams through ``ctx``)."""
    span = int(run.method.params["ctx"]) if run.method.kind == "shift" else None
    return forward_cost(run.length, hidden_size, span)


def plan(
    model_name: str,
    docs: dict[str, str],
    methods: list[Method],
    lengths: list[int],
    out: str | Path,
    dtype: str = "float32",
) -> list[Run]:
    """The runs still needed for the documents ``docs`` (name: text): points already in ``out`` (same
    model, ``dtype``, text...) are skipped.

    A method given twice is refused (:class:`~selfextend.evaluation.methods.MethodError`).
    """
    methods, lengths = unique_methods(list(methods)), check_lengths(lengths)
    done = {point_key(r) for r in own_records(out, "ppl")}
    runs = []
    for doc, text in docs.items():
        tid = text_id(text)
        for method in methods:
            missing = [n for n in lengths if (model_name, dtype, doc, tid, method.name, n) not in done]
            if not missing:
                continue
            if method.length_independent:
                runs.append(Run(doc, method, max(missing), missing, tid))
            else:
                runs += [Run(doc, method, n, [n], tid) for n in missing]
    return runs


def tokenize_docs(tokenizer, docs: dict[str, str], runs: list[Run]) -> dict[str, torch.Tensor]:
    """The token ids each document needs for ``runs``; refuses documents shorter than their longest run."""
    ids = {}
    for name in sorted({r.doc for r in runs}):
        need = max(r.length for r in runs if r.doc == name)
        ids[name] = tokenize_prefix(tokenizer, docs[name], need)
        if ids[name].shape[1] < need:
            raise CorpusError(f"document '{name}' has {ids[name].shape[1]} tokens, fewer than length {need}")
    return ids


def ppl_sweep(
    model: nn.Module,
    model_name: str,
    ids: dict[str, torch.Tensor],
    runs: list[Run],
    out: str | Path,
    progress: Callable[[int], None] | None = None,
) -> Iterator[dict]:
    """Do ``runs`` on the documents' token ``ids``, appending each point's record to ``out`` once known.

    ``progress`` is told how many tokens each run processed (for a progress bar).
    """
    repair_tail(out)
    for run in runs:
        t0 = time.perf_counter()
        nll = score(model, ids[run.doc][:, : run.length], run.method)
        seconds = time.perf_counter() - t0
        broken = int((~torch.isfinite(nll)).sum())
        if broken:  # a NaN or inf in the weights: recorded as "ppl": NaN, the sweep said nothing
            raise ValueError(
                f"{run.doc} under {run.method.name} at {run.length:,} tokens: the model's output is not "
                f"numbers at {broken:,} of them (NaN or inf in its weights?); nothing recorded for it"
            )
        if progress:
            progress(run.length)
        for n in run.covers:
            last_from = n - n // 4
            record = {
                "model": model_name,
                "dtype": dtype_name(model),
                "doc": run.doc,
                "text": run.text,
                "method": run.method.name,
                "length": n,
                "ppl": segment_ppl(nll, 0, n),
                "ppl_last": segment_ppl(nll, last_from, n),
                "last_from": last_from,
                "tokens": n,
                "seconds": round(seconds, 2),
                "forward_length": run.length,
            }
            append_jsonl(out, record)
            yield record
