"""Chat turns as text pieces for a cache that is written once: the system part, then one piece per turn.

Every piece comes from the tokenizer's own chat template (``apply_chat_template``), as the difference
between two renders, the way llama.cpp's ``common_chat_format_single`` does it: the text a template
gives a conversation with the new message, minus the text it gives the conversation before it. Only
the previous exchange is rendered with the new one, so the cost of a turn does not grow with the
conversation. Models without a template get plain ``User:``/``Assistant:`` turns.

A piece for a new user turn is split in two: the *closing* of the previous reply (``<|im_end|>\\n``
in ChatML) belongs to the previous exchange, and the *turn* (header, text, end marker, the
assistant's header) starts the new one. So an exchange starts exactly where the template starts a
user turn, and dropping whole exchanges never leaves half a turn's markers in the cache.
"""

from __future__ import annotations

from selfextend.chat.turns import Exchange
from selfextend.generation.text import apply_template, common_prefix

PLAIN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}"
    "{% elif m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}"
    "{% else %}{{ 'Assistant:' + m['content'] + '\\n\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
PLAIN_STOPS = ("\nUser:",)  # a plain model writes the user's next line itself: stop there


def _after(text: str, prefix: str) -> str:
    """``text`` past ``prefix``; where a template re-renders earlier text differently (trimmed spaces),
    past the part they share, as llama.cpp does."""
    return text[len(prefix) :] if text.startswith(prefix) else text[common_prefix(text, prefix) :]


class ChatTemplate:
    """Renders a conversation into the pieces the cache receives, with the tokenizer's chat template."""

    def __init__(self, tokenizer, system: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.system = system or None
        self.plain = not getattr(tokenizer, "chat_template", None)
        self.stops: tuple[str, ...] = PLAIN_STOPS if self.plain else ()
        bos = tokenizer.bos_token_id
        self.bos = tokenizer.bos_token if bos is not None and tokenizer("a").input_ids[:1] == [bos] else ""
        self.system_text = self._system_part()

    def render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + messages
        if self.plain:
            return self.bos + self._render(msgs, generation_prompt, PLAIN_TEMPLATE)
        return self._render(msgs, generation_prompt, None)

    def _render(self, msgs: list[dict[str, str]], generation_prompt: bool, template: str | None) -> str:
        return apply_template(
            self.tokenizer,
            msgs,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            chat_template=template,
        )

    def _system_part(self) -> str:
        """The text before the first user turn: BOS, the system block (or the template's default one).

        Found from renders with two different user texts: what they share ends with the user header;
        the header itself is what a second user turn starts with after a closed reply. A template
        that writes the system prompt inside the first user turn (Gemma) has no such boundary; then
        the system part runs up to the first user text.
        """
        shared = self.render([{"role": "user", "content": "A"}], True)
        shared = shared[: common_prefix(shared, self.render([{"role": "user", "content": "B"}], True))]
        first = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "X"}]
        closed = self.render(first)
        second = [self.render([*first, {"role": "user", "content": c}], True) for c in "BC"]
        header = second[0][: common_prefix(*second)]
        header = header[len(closed) :] if header.startswith(closed) else ""
        return shared[: -len(header)] if header and shared.endswith(header) else shared

    def first_turn(self, user: str) -> str:
        """The piece for the first user turn, after the system part."""
        return _after(self.render([{"role": "user", "content": user}], True), self.system_text)

    def next_turn(self, previous: Exchange, user: str) -> tuple[str, str]:
        """(closing of the previous reply, the new turn) after ``previous`` has been written and replied."""
        prev = [{"role": "user", "content": previous.user}, {"role": "assistant", "content": previous.reply}]
        written = self.render(prev[:1], True) + previous.reply
        closed = self.render(prev)
        turn = self.render([*prev, {"role": "user", "content": user}], True)
        return _after(closed, written), _after(turn, closed)

    def ids(self, text: str) -> list[int]:
        """Token ids of a piece; the template's own markers (BOS, turn tokens) are already in its text.
        :class:`~selfextend.chat.sessionfile.ChatError` where the text holds what no tokenizer takes: a lone
        surrogate (bytes that were not UTF-8, read with ``surrogateescape`` as standard input is)."""
        from selfextend.chat.sessionfile import ChatError

        try:
            text.encode()
        except UnicodeEncodeError:
            raise ChatError("the text holds bytes that are not UTF-8") from None
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []
