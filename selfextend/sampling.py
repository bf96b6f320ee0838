"""Next-token choice from logits: greedy or sampled (temperature, top-k, top-p, min-p, repetition penalty)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    """Sampling settings; ``temperature == 0`` means greedy. Filters apply in llama.cpp's order."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min-p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition penalty must be > 0, got {self.repetition_penalty}")


def apply_repetition_penalty(logits: torch.Tensor, recent: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on tokens in ``recent``: positive logits divided, negative multiplied."""
    if penalty == 1.0 or recent.numel() == 0:
        return logits
    logits = logits.clone()
    picked = logits[recent]
    logits[recent] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    recent: torch.Tensor,
    generator: torch.Generator | None = None,
) -> int:
    """Pick the next token id from one row of logits (vocab,)."""
    logits = apply_repetition_penalty(logits.float(), recent, params.repetition_penalty)
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_p.cumsum(0) - sorted_p >= params.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
