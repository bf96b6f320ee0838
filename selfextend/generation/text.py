"""Text in and out of the token stream: the prompt's ids (a chat template's or plain text's), the reply's
text as it streams (detokenized without splitting a character, held back where it may start a stop
string), and the tokens that end a reply. The generation loop (:mod:`selfextend.generation.generator`),
chat and the server share them."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from selfextend.core.validate import first_line
from selfextend.models.blocks import TokenIdError


class TextStream:
    """Incremental detokenizer: emits text only once it is complete (no split multi-byte characters)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            # keep the windows short: the prefix is only context for the tokenizer's spacing rules, and
            # the ids before it are dropped (an endless run would otherwise keep every token it wrote)
            del self.ids[: self.read_offset]
            self.prefix_offset, self.read_offset = 0, len(self.ids)
            return text[len(prefix) :]
        return ""


class StopMatcher:
    """Holds back text that may be the start of a stop string; reports when one is complete.

    A stop string that is a special token's text (``<|im_end|>``) is matched by the token's id, given the
    ``tokenizer``: special tokens are left out of the streamed text, so as text it would never match
    (llama-cli matches a one-token stop string by its id too)."""

    def __init__(self, stops: Sequence[str], tokenizer=None) -> None:
        self.stops = [s for s in stops if s]
        ids = (special_token_id(tokenizer, s) for s in self.stops) if tokenizer is not None else ()
        self.token_ids = frozenset(i for i in ids if i is not None)
        self.pending = ""

    def push(self, text: str, token: int | None = None) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped); ``token``: the id whose text ``text`` is."""
        self.pending += text
        if token in self.token_ids:
            out, self.pending = self.pending, ""
            return out, True
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:  # the earliest in the text, whichever of the strings it is (llama.cpp's rule too)
            out, self.pending = self.pending[: min(found)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def special_token_id(tokenizer, text: str) -> int | None:
    """The id of the special token whose text is ``text`` (None: no special token is written so)."""
    return _special_tokens(tokenizer).get(text)


@functools.lru_cache(maxsize=4)
def _special_tokens(tokenizer) -> dict[str, int]:
    """Text to id of the tokens decoding leaves out (built once per tokenizer: Gemma 3 has 6,384 added
    tokens, 4 ms to list, and the server asks per request)."""
    return {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def eos_token_ids(model: nn.Module, tokenizer) -> tuple[int, ...]:
    """The tokens that end a reply: the generation config's end-of-sequence ids and the tokenizer's (those
    the embedding table has rows for: the model can write no other)."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    rows = model.get_input_embeddings().num_embeddings
    return tuple(i for i in ids if 0 <= i < rows)


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback tokens


@functools.cache
def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet read back: each of its 256 characters to the byte it stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_piece(tokenizer, token: int) -> str | list[int]:
    """``token``'s text, or its bytes where they are part of a UTF-8 character (decoded, they read as
    U+FFFD), as llama-server's ``/tokenize`` answers ``with_pieces``: a client joins the bytes of the pieces
    into the text. Bytes are known for byte-level BPE tokens (GPT-2's alphabet: Llama 3, Qwen, SmolLM) and
    SentencePiece's ``<0xNN>`` tokens; another token's decoded text is given as it is."""
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text
    name = tokenizer.convert_ids_to_tokens(token)
    table = _byte_level()
    if m := _BYTE_TOKEN.fullmatch(name):
        raw = bytes([int(m[1], 16)])
    elif name and all(c in table for c in name):
        raw = bytes(table[c] for c in name)
    else:
        return text
    try:
        return raw.decode("utf-8")  # a U+FFFD of its own
    except UnicodeDecodeError:
        return list(raw)


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (token ids or strings)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class ChatTemplateError(ValueError):
    """The model's chat template failed on these messages: a template broken in the file, or one that
    refuses them (``raise_exception``, roles out of order). ``reason`` is the template's own message."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"the model's chat template failed: {reason}")


def apply_template(tokenizer, messages: list[dict[str, str]], **kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template(messages, **kwargs)``, its jinja errors as :class:`ChatTemplateError`
    (they are no ValueError: a broken template in a GGUF ended ``generate`` in a traceback)."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except TemplateError as e:
        raise ChatTemplateError(first_line(e)) from None


def build_prompt(
    tokenizer, prompt: str, system: str | None = None, chat: bool = True
) -> tuple[list[int], int]:
    """Token ids of the prompt and how many leading ones are the system part (BOS, system prompt).

    With a chat template, the system part is what two renders with different user texts share
    (the template's system block and the user header); without, it is the BOS and ``system``. A user
    turn's trailing line breaks are dropped (a file's or ``echo``'s last newline: a piped prompt got
    another reply than the same text given with ``-p``); a plain prompt keeps them (the text continues
    on the next line).
    """
    if chat and getattr(tokenizer, "chat_template", None):
        prompt = prompt.rstrip("\r\n")

        def render(user: str) -> list[int]:
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": user}
            ]
            return list(
                apply_template(tokenizer, msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
            )

        ids = render(prompt)
        return ids, common_prefix(render("A"), render("B"))
    text = f"{system}\n\n{prompt}" if system else prompt
    ids = list(tokenizer(text).input_ids)
    if system:
        return ids, common_prefix(ids, tokenizer(f"{system}\n\n").input_ids)
    return ids, bos_count(tokenizer, ids)


def bos_count(tokenizer, ids: Sequence[int]) -> int:
    """1 where ``ids`` begin with the tokenizer's BOS (a plain prompt's part every shift keeps), else 0."""
    bos = tokenizer.bos_token_id
    return int(bool(ids) and bos is not None and ids[0] == bos)


_INTEGER_TYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def token_ids(ids: Sequence[int] | torch.Tensor, rows: int) -> list[int]:
    """``ids`` (a sequence of ints, or a 1-D integer tensor) as a list of ints, each a row of an embedding
    table of ``rows``; :class:`~selfextend.models.blocks.TokenIdError` (a ValueError) for text (tokenize it
    first), floats, bools, or an id outside ``[0, rows)``."""
    if isinstance(ids, (str, bytes)):
        raise TokenIdError(f"token ids must be integers, got {type(ids).__name__}: tokenize the text first")
    if isinstance(ids, Mapping):  # a tokenizer's whole output (BatchEncoding): its ids are one field of it
        raise TokenIdError("token ids must be a sequence of integers, got a mapping: pass its .input_ids")
    try:
        t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids))
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise TokenIdError(f"token ids must be a sequence of integers: {first_line(exc)}") from None
    if t.numel() == 0:
        return []
    if t.dim() != 1 or t.dtype not in _INTEGER_TYPES:
        got = f"{t.dim()}-D" if t.dim() != 1 else str(t.dtype).removeprefix("torch.")
        hint = " (a batch of one: pass its row [0])" if t.dim() == 2 and len(t) == 1 else ""
        raise TokenIdError(f"token ids must be a sequence of integers, got {got}{hint}")
    if int(t.min()) < 0 or int(t.max()) >= rows:
        raise TokenIdError(f"token ids must lie in [0, {rows}), got {int(t.min())}..{int(t.max())}")
    return t.tolist()
