"""Request bodies of the OpenAI-compatible endpoints, and the one place their sampling fields become ours.

Models are strict (a string where a number belongs is refused, not converted) and let unknown fields
through (OpenAI clients send many this server ignores). Numbers must be finite; ranges are checked here
so that a bad value is a 400 with the field's name, before any work.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from selfextend.core.validate import MAX_SEED
from selfextend.generation.sampling import SamplingParams

Finite = Annotated[float, Field(allow_inf_nan=False)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """Fields shared by both endpoints: OpenAI's and llama.cpp's sampling and length settings."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: Finite | None = Field(None, ge=0.0, le=100.0)
    top_p: Finite | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: Finite | None = Field(None, ge=0.0, lt=1.0)
    repeat_penalty: Finite | None = Field(None, ge=0.01, le=100.0)  # a penalty near 0 overflows the logits
    repeat_last_n: int | None = Field(None, ge=-1)
    frequency_penalty: Finite | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: Finite | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    n_keep: int | None = Field(None, ge=-1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    id_slot: int | None = Field(None, ge=0)
    cache_prompt: bool = True  # llama.cpp's: False recomputes the whole prompt
    ignore_eos: bool = False  # llama.cpp's: True writes past end-of-sequence tokens, to max_tokens

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class SlotFile(Strict):
    filename: str = Field(min_length=1, max_length=255)


GREEDY_BELOW = 1e-4
"""A temperature or top_p under this is greedy: dividing logits by a smaller temperature overflows float32
(and the distribution is one-hot to float precision anyway); a smaller top_p keeps only the top token."""

REQUEST_FIELDS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "repeat_last_n": "repeat_last_n",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
}
"""Request field -> the :class:`SamplingParams` field it sets (llama.cpp's ``repeat_penalty`` is ours
``repetition_penalty``)."""


def sampling_params(request: Sampling, defaults: SamplingParams) -> SamplingParams:
    """The request's sampling settings over the server's ``defaults``, validated."""
    changes: dict[str, Any] = {
        target: getattr(request, name)
        for name, target in REQUEST_FIELDS.items()
        if getattr(request, name) is not None
    }
    if changes.get("temperature", 1.0) < GREEDY_BELOW or changes.get("top_p", 1.0) < GREEDY_BELOW:
        changes["temperature"], changes["top_p"] = 0.0, 1.0
    params = dataclasses.replace(defaults, **changes)
    params.validate()
    return params
