"""Next-token choice from logits: greedy, or sampled through transformers' processors in llama.cpp's order.

llama.cpp's default chain is penalties, top-k, top-p, min-p, then temperature, then the draw: the filters
see the untempered distribution, so the set of tokens kept does not depend on the temperature (dividing by
the temperature first, as transformers' own ``generate`` does, keeps a different set). Before all of them,
as llama.cpp, the logit bias (:class:`LogitBias`: a token's bias added to its logit; -inf bans it). The
repeat, top-k,
top-p, min-p and temperature steps are transformers' processors; the frequency and presence penalties
(OpenAI's, applied by llama.cpp in its penalties step) have no transformers processor, so
:class:`CountPenalty` is ours.

A draw after top-k runs the later filters on the k candidates only, as llama.cpp does (:func:`sample`):
the same distribution (the tokens top-k drops have probability 0 either way), without top-p's and
min-p's sorts of the whole vocabulary (262,144 entries for Gemma 3), which cost more than the decode
step's attention.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from selfextend.core.validate import (
    GREEDY_BELOW,
    MAX_TEMPERATURE,
    PENALTY_RANGE,
    ValidationError,
    check_float,
    check_int,
)


@dataclass
class SamplingParams:
    """Sampling settings; ``temperature == 0`` means greedy (after the penalties). A value out of range
    raises :class:`~selfextend.core.validate.ValidationError` where it is given and where it is used."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64  # tokens the penalties look back over; 0 = none, -1 = the whole context
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the last repeat_last_n tokens
    presence_penalty: float = 0.0  # subtracted once from every token that occurs there
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit; -inf bans

    def __post_init__(self) -> None:
        self.validate()  # a bad value refused where it is given (a Generator validates again: fields change)

    def validate(self) -> None:
        """Refuse settings that cannot work (:class:`~selfextend.core.validate.ValidationError`) and store
        them as plain Python numbers (NumPy scalars become ``int``/``float``); a temperature or top_p under
        :data:`~selfextend.core.validate.GREEDY_BELOW` is greedy (temperature 0, top_p 1)."""
        self.temperature = check_float(self.temperature, "temperature", 0.0, MAX_TEMPERATURE)
        self.top_k = check_int(self.top_k, "top-k", 0)
        self.top_p = check_float(self.top_p, "top-p", 0.0, 1.0)
        # greedy, as near as it gets; top-k 1 is greedy too (tokens tied with the best were drawn among,
        # where llama.cpp's top-k keeps exactly one and greedy takes the first)
        if 0 < self.temperature < GREEDY_BELOW or self.top_p < GREEDY_BELOW or self.top_k == 1:
            self.temperature, self.top_p = 0.0, 1.0
        self.min_p = check_float(self.min_p, "min-p", 0.0, 1.0, hi_open=True)
        self.repetition_penalty = check_float(self.repetition_penalty, "repeat penalty", *PENALTY_RANGE)
        self.repeat_last_n = check_int(self.repeat_last_n, "repeat-last-n", -1)
        self.frequency_penalty = check_float(self.frequency_penalty, "frequency penalty", -2.0, 2.0)
        self.presence_penalty = check_float(self.presence_penalty, "presence penalty", -2.0, 2.0)
        if not isinstance(self.logit_bias, Mapping):
            kind = type(self.logit_bias).__name__
            raise ValidationError("logit bias", f"must map token ids to biases ({{id: bias}}), got a {kind}")
        self.logit_bias = {
            check_int(t, "logit bias token", 0): b
            if b == -math.inf
            else check_float(b, "logit bias", -100, 100)
            for t, b in self.logit_bias.items()
        }

    def check_ids(self, rows: int) -> None:
        """Refuse a ``logit_bias`` that names an id past a table of ``rows`` token ids (no logit would take
        it) or bans all ``rows`` ids (no token would be left to draw: greedy took id 0 and a draw failed
        as if the model's output were broken), :class:`~selfextend.core.validate.ValidationError`."""
        past = sorted(t for t in self.logit_bias if t >= rows)
        if past:  # a bias no logit would take: said, not ignored
            raise ValidationError("logit bias token", f"{past[0]} is past the model's {rows} token ids")
        if sum(b == -math.inf for b in self.logit_bias.values()) >= rows:
            raise ValidationError(
                "logit bias", f"bans every one of the {rows} token ids: none is left to draw"
            )

    def bias(self) -> LogitBias:
        """``logit_bias`` as tensors, built once for each table assigned: a request biasing 50,000 ids
        paid 1.6x per token when they were rebuilt at every token (a table changed in place between
        uses is not seen: assign a new one)."""
        table, made = self.__dict__.get("_bias", (None, None))
        if table is not self.logit_bias:
            made = LogitBias(self.logit_bias)
            self.__dict__["_bias"] = (self.logit_bias, made)
        return made

    def recent(self, tokens: list[int]) -> list[int]:
        """The tokens the penalties look at: the last ``repeat_last_n`` (llama.cpp: 0 = none,
        -1 = every token in the context); none where no penalty is set (nothing reads them, and on a GPU
        each token would copy them over)."""
        penalised = self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty
        if self.repeat_last_n == 0 or not penalised:
            return []
        return tokens if self.repeat_last_n < 0 else tokens[-self.repeat_last_n :]


class CountPenalty(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the tokens passed as ``input_ids``:
    ``logit -= count * frequency + (count > 0) * presence``."""

    def __init__(self, frequency: float, presence: float) -> None:
        self.frequency, self.presence = frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ones = torch.ones_like(input_ids, dtype=scores.dtype)
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids, ones)  # (B, vocab)
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


class LogitBias(LogitsProcessor):
    """Each token's bias added to its score (a bias of -inf bans the token; ids past the scores' width
    are left out): llama.cpp's logit-bias sampler, the first of its chain."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.bias = torch.tensor(list(bias.values()), dtype=torch.float32)
        self._for: tuple = (None, None, None)  # (width, device, dtype) the ones below were cut and cast for
        self._cut = (self.ids, self.bias)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        made = (scores.shape[-1], scores.device, scores.dtype)
        if self._for != made:  # once per width, device and dtype: not at every token
            inside = self.ids < made[0]
            self._cut = self.ids[inside].to(scores.device), self.bias[inside].to(scores.device, scores.dtype)
            self._for = made
        ids, bias = self._cut
        return scores.index_add(-1, ids, bias.expand(*scores.shape[:-1], -1))


def penalties(params: SamplingParams) -> LogitsProcessorList:
    """The steps before top-k for ``params``: the logit bias, repetition, then frequency and presence."""
    chain = LogitsProcessorList()
    if params.logit_bias:
        chain.append(params.bias())
    if params.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        chain.append(CountPenalty(params.frequency_penalty, params.presence_penalty))
    return chain


def filters(params: SamplingParams) -> LogitsProcessorList:
    """The steps after top-k for sampling ``params``: top-p, min-p, temperature."""
    chain = LogitsProcessorList()
    if params.top_p < 1.0:
        chain.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        chain.append(MinPLogitsWarper(params.min_p))
    chain.append(TemperatureLogitsWarper(params.temperature))
    return chain


def processors(params: SamplingParams) -> LogitsProcessorList:
    """The chain for ``params``, in llama.cpp's order: penalties, top-k, top-p, min-p, temperature."""
    chain = penalties(params)
    if params.temperature == 0:
        return chain
    if params.top_k > 0:
        chain.append(TopKLogitsWarper(params.top_k))
    return LogitsProcessorList([*chain, *filters(params)])


def candidates(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """The ids of the tokens top-k keeps in ``scores`` (vocab,): those at least the k-th highest score,
    ties included (as ``TopKLogitsWarper`` keeps them), in increasing id order; a NaN or -inf score is
    never one of them."""
    scores = torch.where(scores.isnan(), float("-inf"), scores)
    kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
    return torch.nonzero((scores >= kth) & (scores > float("-inf"))).squeeze(1)


def any_left(logits: torch.Tensor, params: SamplingParams, recent: torch.Tensor) -> bool:
    """Whether any token of ``logits`` (vocab,) keeps a score above -inf through the logit bias and the
    penalties (a response format's mask and a bias can ban every token; a NaN counts as left, and fails
    the draw as a broken model's output does)."""
    scores = penalties(params)(recent.view(1, -1), logits.float().view(1, -1))[0]
    return not bool((scores == float("-inf")).all())


def argmax(scores: torch.Tensor) -> int:
    """The index of the highest of ``scores`` (vocab,), the first one where several tie; a NaN is never
    picked (as sampling never draws one), and ``ValueError`` where no score is above -inf (NaNs: a broken
    model's output; all -inf: every token banned). On the CPU through NumPy: its vectorized argmax over a
    262k-entry vocabulary takes ~40 us where ``torch.argmax`` takes ~650 (a greedy Gemma 3 token is ~20 ms);
    on a GPU the id and its score come back in one copy."""
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64):
        values = scores.detach().numpy()
        index = int(values.argmax())
        top = float(values[index])
    else:
        at = scores.argmax()
        index, top = torch.stack((at.double(), scores[at].double())).tolist()
        index = int(index)
    if top != top:  # NaN, which an argmax takes as the highest: the highest number instead
        numbers = torch.where(scores.isnan(), float("-inf"), scores)
        index = int(numbers.argmax())
        if not float(numbers[index]) > float("-inf"):
            raise ValueError(
                "cannot pick a token: no logit is a finite number (the model's output is broken)"
            )
    elif top == float("-inf"):  # every token banned: NumPy's argmax would name id 0
        raise ValueError("cannot pick a token: every logit is -inf (no token is left to pick)")
    return index


def _scores(logits: torch.Tensor, params: SamplingParams, recent: torch.Tensor) -> torch.Tensor:
    """One row of logits (vocab,) through the chain, in float32."""
    return processors(params)(recent.view(1, -1), logits.float().view(1, -1))[0]


def distribution(logits: torch.Tensor, params: SamplingParams, recent: torch.Tensor) -> torch.Tensor:
    """The probabilities the next token is drawn from, for one row of logits (vocab,) and the penalised
    tokens ``recent``; for greedy settings, one-hot at the penalised argmax."""
    scores = _scores(logits, params, recent)
    if params.temperature == 0:
        return torch.nn.functional.one_hot(scores.argmax(), scores.numel()).float()
    return torch.softmax(scores, dim=-1)


def candidate_distribution(
    logits: torch.Tensor, params: SamplingParams, recent: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, probabilities) of top-k's candidates for sampling ``params`` with ``top_k > 0``: the later
    filters and the softmax run on the candidates only. Equal to :func:`distribution` at ``ids``, which is
    zero everywhere else. Raises ``ValueError`` where no logit is a number."""
    recent = recent.view(1, -1)
    scores = penalties(params)(recent, logits.float().view(1, -1))[0]  # (vocab,)
    ids = candidates(scores, params.top_k)
    if len(ids) == 0:
        raise ValueError("cannot sample: no logit is a finite number (the model's output is broken)")
    kept = filters(params)(recent, scores[ids].view(1, -1))[0]  # (candidates,)
    return ids, torch.softmax(kept, dim=-1)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    recent: torch.Tensor,
    generator: torch.Generator | None = None,
) -> int:
    """Pick the next token id from one row of logits (vocab,), given the recent tokens (for penalties);
    after top-k, among its candidates (:func:`candidate_distribution`). A draw runs on the CPU, where
    ``generator`` (a CPU generator) is: a seed gives the same tokens from the same logits on any device."""
    if params.temperature == 0:
        return argmax(_scores(logits, params, recent))
    logits, recent = logits.cpu(), recent.cpu()  # (vocab,): one small copy beside the token's sync
    if params.top_k == 0:
        return int(torch.multinomial(distribution(logits, params, recent), 1, generator=generator))
    ids, probs = candidate_distribution(logits, params, recent)
    return int(ids[torch.multinomial(probs, 1, generator=generator)])
