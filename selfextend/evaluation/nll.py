"""Scoring text: per-token negative log-likelihood and perplexity without a (L, vocab) logits tensor."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from selfextend.core.validate import ValidationError
from selfextend.hf.facts import cache_kwargs


def _head_nll(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """NLL of ``targets`` (n,) under the output head applied to ``hidden`` (n, hidden_size)."""
    logits = model.get_output_embeddings()(hidden).float()  # (n, vocab)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return F.cross_entropy(logits, targets.to(logits.device), reduction="none").cpu()


@torch.no_grad()
def token_nll(
    model: nn.Module, ids: torch.Tensor, chunk: int = 1024, prefill_chunk: int | None = None
) -> torch.Tensor:
    """NLL (nats) of tokens 1..L-1 of ``ids`` (1, L) given their prefix.

    The decoder runs once over the whole sequence, or with ``prefill_chunk``, over chunks of that
    many tokens through transformers' own ``DynamicCache`` (built from the config, so sliding-window
    layers keep only their window), as a chunked prefill does: the same math, but no (L, L) mask.
    The output head and the cross-entropy run ``chunk`` positions at a time, so memory holds
    (chunk, vocab) logits, never (L, vocab).
    """
    from transformers import DynamicCache

    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValidationError("ids", f"must be one sequence of shape (1, L), got {tuple(ids.shape)}")
    decoder = getattr(model, model.base_model_prefix)
    targets = ids[0, 1:]
    nll = torch.empty(targets.shape[0], dtype=torch.float32)
    step = prefill_chunk or ids.shape[1]
    cache = DynamicCache(config=model.config) if prefill_chunk else None
    for s in range(0, ids.shape[1], step):
        part = ids[:, s : s + step].to(model.device)
        hidden = decoder(
            input_ids=part, **cache_kwargs(decoder, cache), use_cache=cache is not None
        ).last_hidden_state[0]
        end = min(s + step, targets.shape[0])  # hidden[i] scores token s + i + 1
        for a in range(s, end, chunk):
            b = min(a + chunk, end)
            nll[a:b] = _head_nll(model, hidden[a - s : b - s], targets[a:b])
    return nll


def dense_sliding_mask(model: nn.Module) -> bool:
    """Whether a plain forward of ``model`` builds an (L, L) mask: sliding-window layers under transformers'
    SDPA (a Gemma 3 forward of 64k tokens would hold a 4 GiB boolean mask and score every pair). Such
    models are scored with a chunked prefill (:func:`token_nll`'s ``prefill_chunk``)."""
    from selfextend.hf.facts import layer_kinds
    from selfextend.hf.patch import IMPLEMENTATION

    config = model.config.get_text_config()
    return config._attn_implementation != IMPLEMENTATION and "sliding_attention" in layer_kinds(model)


@torch.no_grad()
def shift_nll(
    model: nn.Module, ids: torch.Tensor, n_ctx: int, n_keep: int = 0, chunk: int = 256
) -> torch.Tensor:
    """NLL of tokens 1..L-1 when the text streams through a context-shift cache of ``n_ctx`` tokens.

    Chunks of at most ``chunk`` tokens are written after making room; each token is scored
    against whatever the cache holds at that moment, as during endless generation. A chunk stops where
    the cache is full, so shifts come at the same tokens whatever the text's length: a prefix scores as
    a shorter run of it does (one stream serves every shorter length of a sweep; a chunk that did not
    fit shifted the cache a few tokens early, and the length-256 point from a 512-token stream differed).
    """
    from selfextend.kv.cache import ContextShiftCache

    decoder = getattr(model, model.base_model_prefix)
    cache = ContextShiftCache(model, n_ctx=n_ctx, n_keep=n_keep)
    step = min(chunk, cache.max_chunk())
    targets = ids[0, 1:]
    nll = torch.empty(targets.shape[0], dtype=torch.float32)
    a = 0
    while a < targets.shape[0]:
        b = min(a + (min(step, cache.free()) or step), targets.shape[0])
        cache.make_room(b - a)
        out = decoder(input_ids=ids[:, a:b].to(model.device), **cache_kwargs(decoder, cache), use_cache=True)
        nll[a:b] = _head_nll(model, out.last_hidden_state[0], targets[a:b])
        a = b
    return nll


def perplexity(nll: torch.Tensor) -> float:
    """exp(mean NLL); ValidationError for no NLL at all (a text of one token: the mean of nothing was NaN)."""
    if nll.numel() == 0:
        raise ValidationError("NLL", "is empty: a perplexity needs at least 2 tokens")
    return math.exp(nll.double().mean().item())


def segment_ppl(nll: torch.Tensor, start: int, end: int) -> float:
    """Perplexity of the tokens at positions [start, end) of the scored sequence.

    ``nll[t]`` scores token ``t + 1``, so positions map to ``nll[start - 1 : end - 1]``.
    """
    return perplexity(nll[max(start - 1, 0) : end - 1])
