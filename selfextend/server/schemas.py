"""Request bodies of the OpenAI-compatible endpoints, and the one place their sampling fields become ours.

Models are strict (a string where a number belongs is refused, not converted) and let unknown fields
through (OpenAI clients send many this server ignores). Numbers must be finite; ranges are checked here
so that a bad value is a 400 with the field's name, before any work. A field that would change what the
answer means and that this server does not implement (:data:`UNSUPPORTED`: tool calls, log
probabilities...) is a 400 naming it unless its value asks for nothing, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from selfextend.core.validate import MAX_SEED, MAX_TEMPERATURE, PENALTY_RANGE
from selfextend.generation.grammar import Grammar
from selfextend.generation.sampling import SamplingParams
from selfextend.server.guard import APIError

Finite = Annotated[float, Field(allow_inf_nan=False)]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class StreamOptions(Strict):
    include_usage: bool = False


UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tools": ("tool calls", ([],)),
    "tool_choice": ("tool calls", ("none", "auto")),  # "auto" with no tools: none
    "functions": ("function calls", ([],)),
    "function_call": ("function calls", ("none",)),
    "logprobs": ("log probabilities", (False,)),
    "top_logprobs": ("log probabilities", (0,)),
    "echo": ("echoing the prompt", (False,)),
    "suffix": ("suffixes (insertion)", ("",)),
    "best_of": ("several candidates (best_of)", (1,)),
    "grammar": ("GBNF grammars (response_format json_schema is)", ("",)),
    "modalities": ("audio output", (["text"],)),
    "audio": ("audio output", ()),
    # llama-server's samplers and settings beyond ours, at their values that turn them off
    "mirostat": ("mirostat sampling", (0,)),
    "typical_p": ("locally typical sampling (typical_p)", (1,)),
    "dry_multiplier": ("the DRY repetition penalty", (0,)),
    "xtc_probability": ("XTC sampling", (0,)),
    "top_n_sigma": ("top-n-sigma sampling", (-1,)),
    "dynatemp_range": ("dynamic temperature", (0,)),
    "min_keep": ("min_keep", (0,)),
    "samplers": ("another order of the samplers", ()),
    "n_probs": ("token probabilities (n_probs)", (0,)),
    "t_max_predict_ms": ("time limits (t_max_predict_ms)", (0,)),
    "chat_template_kwargs": ("arguments to the chat template", ({},)),
    "add_generation_prompt": ("a chat prompt without the assistant's header", (True,)),
    "continue_final_message": ("continuing the last message", (False,)),
}
"""Field -> (what this server does not do, the values that ask for none of it; None always does). A value
asks for none of it only as the same kind of value: ``logprobs: 0`` asks for the chosen tokens' log
probabilities where ``false`` asks for none."""

Bias = float | Literal[False]
TOKEN_ID = re.compile(r"-?[0-9]+")  # a logit_bias key of ASCII digits alone is an id (" 2024" is text)
MAX_STOPS = 64  # stop strings a request may give (OpenAI takes 4): each is looked for at every token


class ResponseFormat(Strict):
    """OpenAI's ``response_format``; llama.cpp's ``schema`` beside ``type`` is taken too."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # OpenAI's {"name", "schema", "strict"}
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    def schema_of(self) -> dict[str, Any] | None:
        """The JSON schema the reply must follow, None for plain text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return self.schema_ or {"type": "object"}
        schema = (self.json_schema or {}).get("schema", self.schema_)
        if schema is True:  # JSON Schema's "anything": any JSON document
            return {}
        if not isinstance(schema, dict):
            said = "none" if schema is None else json.dumps(schema)[:40]
            message = f"response_format json_schema needs a schema object in json_schema.schema, got {said}"
            raise APIError(400, message, "response_format")
        return schema


class Sampling(Strict):
    """Fields shared by both endpoints: OpenAI's and llama.cpp's sampling and length settings."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for it
    temperature: Finite | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: Finite | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: Finite | None = Field(None, ge=0.0, lt=1.0)
    repeat_penalty: Finite | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    repeat_last_n: int | None = Field(None, ge=-1)
    frequency_penalty: Finite | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: Finite | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-1, le=MAX_SEED)  # -1: a random one (llama.cpp's), as none
    stop: str | list[str] | None = None
    n: int | None = Field(1, ge=1, le=1)  # null: 1, as OpenAI's
    n_predict: int | None = Field(None, ge=-1)  # llama.cpp's max_tokens (-1: unsaid)
    n_keep: int | None = Field(None, ge=-1)
    stream: bool | None = False  # null: false, as OpenAI's
    stream_options: StreamOptions | None = None
    id_slot: int | None = Field(None, ge=-1)  # -1: any idle slot (llama.cpp's default), as none
    cache_prompt: bool = True  # llama.cpp's: False recomputes the whole prompt
    # llama.cpp's: drafts checked per pass at most (0: none), within the server's --lookup / --draft-max
    speculative_n_max: int | None = Field(None, ge=0, alias="speculative.n_max")
    speculative: dict[str, Any] | None = None  # {"n_max": N}: the same, nested
    ignore_eos: bool = False  # llama.cpp's: True writes past end-of-sequence tokens, to max_tokens
    logit_bias: dict[str, Bias] | list[list[Any]] | None = None  # id or text -> bias, or [id or text, bias]
    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = None  # llama.cpp's: the schema the reply follows
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    grammar: Any = None
    modalities: Any = None
    audio: Any = None
    mirostat: Any = None
    typical_p: Any = None
    dry_multiplier: Any = None
    xtc_probability: Any = None
    top_n_sigma: Any = None
    dynatemp_range: Any = None
    min_keep: Any = None
    samplers: Any = None
    n_probs: Any = None
    t_max_predict_ms: Any = None
    chat_template_kwargs: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOPS:
            raise PydanticCustomError(
                "stop",
                f"at most {MAX_STOPS} stop strings (each is looked for at every token), got {len(value)}",
            )
        return value

    @field_validator("seed", "id_slot")
    @classmethod
    def _unsaid(cls, value: int | None) -> int | None:
        return None if value == -1 else value  # llama.cpp's "a random seed", "any slot": as none given

    @field_validator("stream_options")
    @classmethod
    def _streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError("stream_options", "only allowed with stream: true (as OpenAI's)")
        return value

    @field_validator("speculative")
    @classmethod
    def _nested(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        """``{"n_max": N}``, the nested spelling of ``speculative.n_max`` (which must agree if given)."""
        if value is None:
            return None
        n_max = value.get("n_max")
        if set(value) != {"n_max"} or type(n_max) is not int or n_max < 0:
            raise PydanticCustomError("speculative", "takes n_max alone, an integer >= 0")
        if info.data.get("speculative_n_max") not in (None, n_max):
            raise PydanticCustomError("speculative", "n_max is given twice (speculative.n_max), differently")
        return value

    def draft_max(self) -> int | None:
        """Drafts per pass at most, from ``speculative.n_max`` or ``speculative: {"n_max": N}``."""
        return self.speculative["n_max"] if self.speculative is not None else self.speculative_n_max

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, Bias] | list[list[Any]] | None) -> list[tuple[int | str, Bias]]:
        """Pairs of (id or text, bias): numbers in [-100, 100], or false."""
        pairs = list(value.items()) if isinstance(value, dict) else [tuple(p) for p in value or []]
        for pair in pairs:
            key, bias = pair if len(pair) == 2 else (None, None)
            number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
            if not isinstance(key, (int, str)) or isinstance(key, bool) or not (number or bias is False):
                raise PydanticCustomError("logit_bias", "entries are [token id or text, bias]")
            if key == "":
                raise PydanticCustomError("logit_bias", "a key is empty text (no token to bias)")
            if number and not (math.isfinite(bias) and -100 <= bias <= 100):
                raise PydanticCustomError("logit_bias", f"biases must be in [-100, 100] or false, got {bias}")
        return pairs

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        what, neutral = UNSUPPORTED[info.field_name]
        if value is not None and not any(_same(value, n) for n in neutral):
            raise PydanticCustomError("unsupported", f"this server does not implement {what}")
        return value

    def token_limit(self) -> tuple[int | None, str]:
        """(the most tokens the reply may have, None where unsaid; the field that said it): ``max_tokens``,
        OpenAI's ``max_completion_tokens`` or llama.cpp's ``n_predict``, a 400 where two are given and
        differ."""
        if self.n_predict == 0:
            raise APIError(400, "n_predict must be at least 1 (or -1: unsaid)", "n_predict")
        given = [
            (value, name)
            for name in ("max_tokens", "max_completion_tokens", "n_predict")
            if (value := getattr(self, name)) is not None and value != -1
        ]
        if len({value for value, _ in given}) > 1:
            said = " and ".join(f"{name} {value}" for value, name in given)
            raise APIError(400, f"{said} differ", given[-1][1])
        return given[0] if given else (None, "max_tokens")

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral`` with booleans apart from numbers (``0 == False`` in Python)."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = Field(None, validate_default=True)  # null: an assistant turn only
    tool_calls: list[Any] | None = None  # an assistant's: none (it was left out of the prompt unsaid)

    @field_validator("tool_calls")
    @classmethod
    def _no_calls(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise PydanticCustomError("unsupported", "this server does not implement tool calls")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            if any(not isinstance(p, dict) or not isinstance(p.get("type"), str) for p in value):
                example = '{"type": "text", "text": "Hi"}'
                raise PydanticCustomError("content", f"a part is an object such as {example}")
            kinds = sorted({p["type"] for p in value} - {"text"})
            if kinds:
                raise PydanticCustomError(
                    "content", f"this server reads text only, not {', '.join(kinds)} parts"
                )
            if any(not isinstance(p.get("text"), str) for p in value):
                raise PydanticCustomError("content", 'a text part needs its "text", a string')
        return value

    @field_validator("content")
    @classmethod
    def _said(cls, value: str | list[TextPart] | None, info: ValidationInfo) -> str | list[TextPart] | None:
        if value is None and info.data.get("role") != "assistant":
            raise PydanticCustomError("content", "a message needs content (null is an assistant turn's only)")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class SlotFile(Strict):
    filename: str = Field(min_length=1, max_length=255)


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


def logit_bias(request: Sampling, tokenizer) -> dict[int, float]:
    """``logit_bias`` as llama-server reads it: keys are token ids, or text whose every token gets the
    bias (an object's keys are strings: those that are integers are ids); a bias of ``false`` or -100
    (OpenAI's "ban") bans the token, others are added to its logit. :class:`APIError` for an id outside
    the vocabulary."""
    out: dict[int, float] = {}
    for key, bias in request.logit_bias or []:
        key = int(key) if isinstance(key, str) and TOKEN_ID.fullmatch(key) else key
        ids = tokenizer(key, add_special_tokens=False).input_ids if isinstance(key, str) else [key]
        if any(not 0 <= t < len(tokenizer) for t in ids):
            raise APIError(400, f"logit_bias token ids must be in [0, {len(tokenizer)})", "logit_bias")
        out.update(dict.fromkeys(ids, -math.inf if bias is False or bias == -100 else float(bias)))
    return out


def response_grammar(request: Sampling, tokenizer, eos: tuple[int, ...]) -> Grammar | None:
    """The grammar the reply must follow (``response_format`` json_object / json_schema, or llama.cpp's
    ``json_schema``), None for free text. :class:`APIError` for a schema llguidance cannot use."""
    schema = request.response_format.schema_of() if request.response_format is not None else None
    if schema is not None and request.json_schema is not None:
        raise APIError(400, "give the schema once: in response_format or in json_schema", "json_schema")
    schema = request.json_schema if schema is None else schema
    if schema is None:
        return None
    if request.ignore_eos:
        raise APIError(400, "ignore_eos would write past the end of the JSON document", "ignore_eos")
    try:
        return Grammar(tokenizer, schema, eos)
    except ValueError as e:
        raise APIError(400, str(e), "response_format") from None


def sampling_params(request: Sampling, defaults: SamplingParams, tokenizer) -> SamplingParams:
    """The request's sampling settings over the server's ``defaults``, validated (a temperature or top_p
    near 0 made greedy: :data:`~selfextend.core.validate.GREEDY_BELOW`)."""
    changes: dict[str, Any] = {
        target: getattr(request, name)
        for name, target in REQUEST_FIELDS.items()
        if getattr(request, name) is not None
    }
    if request.logit_bias:
        changes["logit_bias"] = logit_bias(request, tokenizer)
    params = dataclasses.replace(defaults, **changes)
    params.validate()
    if request.logit_bias:
        params.check_ids(len(tokenizer))
    return params
