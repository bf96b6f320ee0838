"""Requests to token ids: the body read, chat messages through the model's chat template, completion prompts
as given.

The tokens kept at every context shift (``n_keep``) default to the system part for a chat (what the
template writes before the first user turn: BOS and the system prompt, as ``selfextend chat`` keeps) and
to the BOS for a completion, or where there is none to the first 4 tokens (the attention sinks,
:func:`~selfextend.kv.cache.default_keep`); ``n_keep = -1`` keeps the whole prompt, as llama.cpp's.

Everything here may take long on a big body (parsing millions of token ids, tokenising megabytes of text),
so the routes run it off the event loop. Text a tokenizer cannot take (a lone surrogate such as
``"\\ud800"``, which JSON can spell) and NUL characters are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

import pydantic
from fastapi.exceptions import RequestValidationError

from selfextend.chat.template import ChatTemplate
from selfextend.generation.text import ChatTemplateError, bos_count, common_prefix
from selfextend.kv.cache import default_keep
from selfextend.server.guard import NOT_JSON, TOO_DEEP, APIError
from selfextend.server.schemas import Message, Sampling

Body = TypeVar("Body", bound=Sampling)
Model = TypeVar("Model", bound=pydantic.BaseModel)


@dataclass
class Prompt:
    ids: list[int]
    n_keep: int
    stops: tuple[str, ...] = ()
    chat: bool = False


def too_long(n: int, limit: int) -> APIError:
    """The refusal of a prompt of ``n`` tokens over ``limit``."""
    return APIError(
        400,
        f"the prompt has {n} tokens; this server takes at most {limit} (--max-prompt-tokens)",
        "prompt",
        "context_length_exceeded",
    )


def parse_json(body: bytes) -> Any:
    """A request's ``body`` as JSON whatever its content type says (llama-server's clients, and curl's
    ``-d``, send JSON as a form): :class:`APIError` where it does not parse."""
    try:
        return json.loads(body)
    except ValueError:  # bad JSON, bytes that are not UTF-8
        raise APIError(400, NOT_JSON, None, "invalid_json") from None
    except RecursionError:  # arrays nested 1,000 deep
        raise APIError(400, TOO_DEEP, None, "invalid_json") from None


def validated(data: Any, kind: type[Model]) -> Model:
    """Parsed JSON as ``kind``: ``RequestValidationError`` (a 400 naming the field) for fields of the wrong
    type or range; :class:`APIError` for JSON that is not an object (pydantic's message named our class)."""
    if not isinstance(data, dict):
        kinds = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}
        raise APIError(
            400,
            f"the request body must be a JSON object, not {kinds.get(type(data), 'a number')}",
            None,
            "invalid_json",
        )
    try:
        return kind.model_validate(data)
    except pydantic.ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None


NORMALIZING = 4  # how many characters a tokenizer's normalizer may fold into one (NFC: Hangul jamo, 3)


@lru_cache(maxsize=4)
def longest_token(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` stands for (its special tokens too): a text of ``n``
    characters is at least ``n / (NORMALIZING * longest_token)`` tokens. SmolLM2: 81, in 0.1 s."""
    return max(len(tokenizer.convert_tokens_to_string([t])) for t in tokenizer.get_vocab())


def _text_chars(data: dict[str, Any]) -> int:
    """Characters of the text a raw request asks to tokenize: a completion's prompt (alone or the one of a
    list), a chat's message contents (strings, or the text of their parts)."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    n = len(prompt) if isinstance(prompt, str) else 0
    for m in data.get("messages") if isinstance(data.get("messages"), list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [{"text": content}]
        n += sum(len(p["text"]) for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def read_body(body: bytes, kind: type[Body], max_prompt: int, per_token: int = 0) -> Body:
    """The request ``body`` (JSON) as ``kind``: :class:`APIError` for JSON that does not parse or a prompt
    of more than ``max_prompt`` token ids (counted before the validation, which takes seconds on millions),
    or of text too long to be ``max_prompt`` tokens of at most ``per_token`` characters each (0: not
    checked; a 7.8 MB text took 18 s of tokenizing before its refusal);
    ``RequestValidationError`` for fields of the wrong type or range."""
    data = parse_json(body)
    ids = data.get("prompt") if isinstance(data, dict) else None
    if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):  # [[ids]]: one prompt
        ids = ids[0]
    if isinstance(ids, list) and len(ids) > max_prompt:
        raise too_long(len(ids), max_prompt)
    chars = _text_chars(data) if isinstance(data, dict) and per_token else 0
    if chars > NORMALIZING * per_token * max_prompt:
        raise APIError(
            400,
            f"the prompt's {chars} characters are more than {max_prompt} tokens (--max-prompt-tokens) "
            f"can hold: this tokenizer's tokens stand for {per_token} characters at most",
            "prompt" if "prompt" in data else "messages",
            "context_length_exceeded",
        )
    request = validated(data, kind)
    for i, stop in enumerate(request.stops()):
        check_text(stop, "stop" if isinstance(request.stop, str) else f"stop.{i}")
    return request


def check_text(text: str, param: str) -> None:
    """:class:`APIError` (400, naming ``param``) where ``text`` holds a NUL or cannot be encoded (a lone
    surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        bad = f"a lone surrogate (U+{ord(text[e.start]):04X})"
    else:
        if "\x00" not in text:
            return
        bad = "a NUL character"
    raise APIError(400, f"{param}: the text holds {bad}, which is not valid text", param, "invalid_value")


def _keep(n_keep: int | None, n_system: int, n: int, n_ctx: int) -> int:
    if n_keep is None:
        return default_keep(min(n_system, n), n, n_ctx)
    return n if n_keep == -1 else min(n_keep, n)


def completion_prompt(
    tokenizer,
    prompt: str | list[str] | list[int] | list[list[int]],
    n_keep: int | None,
    vocab: int | None = None,
    n_ctx: int = 2**31,
) -> Prompt:
    """A completion prompt: text or token ids (each alone or as a list of one prompt, as OpenAI's), for a
    cache of ``n_ctx`` cells. :class:`APIError` for more than one prompt or an id outside the vocabulary:
    ``[0, vocab)``, the ids the model's embedding table holds rows for (the engine's ``vocab``), else the
    tokenizer's."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request (n = 1)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        ids = list(tokenizer(prompt).input_ids) if prompt else []
    else:
        ids, vocab = list(prompt), len(tokenizer) if vocab is None else vocab
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"token ids must be in [0, {vocab})", "prompt")
    return Prompt(ids, _keep(n_keep, bos_count(tokenizer, ids), len(ids), n_ctx))


@lru_cache(maxsize=16)
def _template(tokenizer, system: str | None) -> ChatTemplate:
    return ChatTemplate(tokenizer, system)


def render_chat(
    tokenizer, messages: Sequence[Message], generation_prompt: bool = True
) -> tuple[ChatTemplate, str]:
    """(the template, the text) of the messages rendered with the model's chat template and (unless told
    not to) a generation prompt. A leading system (or developer) message is the system prompt. ValueError
    where the template refuses them."""
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    for i, turn in enumerate(turns):
        check_text(turn["content"], f"messages.{i}.content")
    system = turns[0]["content"] if turns[0]["role"] == "system" else None
    rest = turns[1:] if system is not None else turns
    try:
        template = _template(tokenizer, system or None)
        return template, template.render(rest, generation_prompt=generation_prompt)
    except ChatTemplateError as e:
        raise ValueError(e.reason) from None


def chat_prompt(tokenizer, messages: Sequence[Message], n_keep: int | None, n_ctx: int = 2**31) -> Prompt:
    """The messages as :func:`render_chat` renders them, in token ids, for a cache of ``n_ctx`` cells.
    ValueError where the template refuses them."""
    template, text = render_chat(tokenizer, messages)
    ids = template.ids(text)
    keep = (
        common_prefix(ids, template.ids(template.system_text)) if text.startswith(template.system_text) else 0
    )
    return Prompt(ids, _keep(n_keep, keep, len(ids), n_ctx), template.stops, chat=True)
