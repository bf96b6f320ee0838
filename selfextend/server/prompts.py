"""Requests to token ids: chat messages through the model's chat template, completion prompts as given.

The tokens kept at every context shift (``n_keep``) default to the system part for a chat (what the
template writes before the first user turn: BOS and the system prompt, as ``selfextend chat`` keeps) and
to none for a completion; ``n_keep = -1`` keeps the whole prompt, as llama.cpp's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from jinja2 import TemplateError

from selfextend.chat.template import ChatTemplate
from selfextend.generation.generator import common_prefix
from selfextend.server.guard import APIError
from selfextend.server.schemas import Message


@dataclass
class Prompt:
    ids: list[int]
    n_keep: int
    stops: tuple[str, ...] = ()
    chat: bool = False


def _keep(n_keep: int | None, default: int, n: int) -> int:
    if n_keep is None:
        return min(default, n)
    return n if n_keep == -1 else min(n_keep, n)


def completion_prompt(tokenizer, prompt: str | list[str] | list[int], n_keep: int | None) -> Prompt:
    """A completion prompt: text (a one-element list of text too) or token ids. :class:`APIError` for more
    than one prompt or an id outside the vocabulary."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request (n = 1)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt).input_ids) if prompt else []
    else:
        ids = list(prompt)
        if any(not 0 <= t < len(tokenizer) for t in ids):
            raise APIError(400, f"token ids must be in [0, {len(tokenizer)})", "prompt")
    return Prompt(ids, _keep(n_keep, 0, len(ids)))


@lru_cache(maxsize=16)
def _template(tokenizer, system: str | None) -> ChatTemplate:
    return ChatTemplate(tokenizer, system)


def render_chat(tokenizer, messages: Sequence[Message]) -> tuple[ChatTemplate, str]:
    """(the template, the text) of the messages rendered with the model's chat template and a generation
    prompt. A leading system (or developer) message is the system prompt. ValueError where the template
    refuses them."""
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    system = turns[0]["content"] if turns[0]["role"] == "system" else None
    rest = turns[1:] if system is not None else turns
    try:
        template = _template(tokenizer, system or None)
        return template, template.render(rest, generation_prompt=True)
    except TemplateError as e:
        raise ValueError(str(e)) from None


def chat_prompt(tokenizer, messages: Sequence[Message], n_keep: int | None) -> Prompt:
    """The messages as :func:`render_chat` renders them, in token ids. ValueError where the template
    refuses them."""
    template, text = render_chat(tokenizer, messages)
    ids = template.ids(text)
    keep = (
        common_prefix(ids, template.ids(template.system_text)) if text.startswith(template.system_text) else 0
    )
    return Prompt(ids, _keep(n_keep, keep, len(ids)), template.stops, chat=True)
