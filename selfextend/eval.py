"""Scoring text: per-token negative log-likelihood and perplexity without a (L, vocab) logits tensor."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def token_nll(model: nn.Module, ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """NLL (nats) of tokens 1..L-1 of ``ids`` (1, L) given their prefix, from one forward.

    The decoder runs once over the whole sequence; the output head and the cross-entropy run
    ``chunk`` positions at a time, so memory holds (chunk, vocab) logits, never (L, vocab).
    """
    decoder = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    hidden = decoder(input_ids=ids.to(model.device)).last_hidden_state[0]  # (L, hidden)
    targets = ids[0, 1:].to(hidden.device)
    cap = getattr(model.config, "final_logit_softcapping", None)
    nll = torch.empty(targets.shape[0], dtype=torch.float32)
    for a in range(0, targets.shape[0], chunk):
        b = min(a + chunk, targets.shape[0])
        logits = head(hidden[a:b]).float()  # (chunk, vocab)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        nll[a:b] = F.cross_entropy(logits, targets[a:b], reduction="none").cpu()
    return nll


def perplexity(nll: torch.Tensor) -> float:
    """exp(mean NLL)."""
    return math.exp(nll.double().mean().item())


def segment_ppl(nll: torch.Tensor, start: int, end: int) -> float:
    """Perplexity of the tokens at positions [start, end) of the scored sequence.

    ``nll[t]`` scores token ``t + 1``, so positions map to ``nll[start - 1 : end - 1]``.
    """
    return perplexity(nll[max(start - 1, 0) : end - 1])
