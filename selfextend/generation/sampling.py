"""Next-token choice from logits: greedy or sampled (temperature, top-k, top-p, min-p, repetition penalty)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfextend.core.validate import check_float, check_int


@dataclass
class SamplingParams:
    """Sampling settings; ``temperature == 0`` means greedy. Filters apply in llama.cpp's order."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64  # tokens the repeat penalty looks back over; 0 = none, -1 = the whole context

    def validate(self) -> None:
        """Refuse settings that cannot work (:class:`~selfextend.core.validate.ValidationError`),
        and store them
        as plain Python numbers (NumPy scalars become ``int``/``float``)."""
        self.temperature = check_float(self.temperature, "temperature", 0.0)
        self.top_k = check_int(self.top_k, "top-k", 0)
        self.top_p = check_float(self.top_p, "top-p", 0.0, 1.0, lo_open=True)
        self.min_p = check_float(self.min_p, "min-p", 0.0, 1.0, hi_open=True)
        self.repetition_penalty = check_float(self.repetition_penalty, "repeat penalty", 0.0, lo_open=True)
        self.repeat_last_n = check_int(self.repeat_last_n, "repeat-last-n", -1)

    def recent(self, tokens: list[int]) -> list[int]:
        """The tokens the repeat penalty looks at: the last ``repeat_last_n`` (llama.cpp: 0 = none,
        -1 = every token in the context)."""
        if self.repeat_last_n == 0:
            return []
        return tokens if self.repeat_last_n < 0 else tokens[-self.repeat_last_n :]


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
