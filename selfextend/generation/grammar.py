"""Structured output: which tokens may come next under a JSON schema, through llguidance (as llama.cpp).

A :class:`Grammar` follows one reply token by token: :meth:`Grammar.allowed` is the mask of the tokens
that keep the text a prefix of a document the schema accepts (only the end-of-sequence tokens once it is
complete), :meth:`Grammar.consume` moves it past the token drawn. :class:`GrammarMask` applies the mask
as a transformers logits processor, the first step of the sampling chain (llama.cpp applies the grammar
before its other samplers), so every token drawn keeps the reply valid.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance
import llguidance.hf
import torch
from transformers import LogitsProcessor

from selfextend.core.validate import ValidationError

BITS = torch.arange(32, dtype=torch.int32)
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""One space after commas and colons, no other whitespace (no blank lines a greedy reply can loop in)."""


@lru_cache(maxsize=4)
def _tokenizer(tokenizer, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a fast Hugging Face tokenizer (about a second to build: once per process)."""
    return llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos))


class NoTokenLeft(Exception):
    """The grammar and the sampling settings together leave no token to draw (a logit bias banning every
    token the grammar allows next). ``accepting``: whether the reply is already a complete document."""

    def __init__(self, accepting: bool) -> None:
        super().__init__("no token is left that the response format allows")
        self.accepting = accepting


class Grammar:
    """A JSON schema matched against one reply, token by token. ``eos``: the tokens that end a reply
    (allowed once the document is complete). :class:`ValidationError` for a schema llguidance refuses."""

    def __init__(self, tokenizer, schema: dict[str, Any], eos: tuple[int, ...]) -> None:
        self.tokenizer = _tokenizer(tokenizer, tuple(eos))
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=LAYOUT)
        except ValueError as e:
            raise ValidationError("response_format", f"schema is not usable: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValidationError("response_format", f"schema is not usable: {' '.join(error.split())[:300]}")
        self.matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        self.bits = torch.zeros((self.tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        self.allowed(self.tokenizer.vocab_size)  # the first mask: where no document matches, an error now
        if self.matcher.is_error():  # a schema with no finite document ($ref to itself): an empty reply
            raise ValidationError("response_format", "schema is not usable: no JSON document matches it")

    def allowed(self, n_vocab: int) -> torch.Tensor:
        """(n_vocab,) bool: the tokens that may come next (ids the tokenizer does not have never may)."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.bits.numel() * 4)
        mask = ((self.bits.view(-1, 1) >> BITS) & 1).bool().view(-1)[: self.tokenizer.vocab_size]
        out = torch.zeros(n_vocab, dtype=torch.bool)
        n = min(n_vocab, mask.numel())
        out[:n] = mask[:n]
        return out

    def accepting(self) -> bool:
        """Whether the text so far is a complete document the schema accepts."""
        return self.matcher.is_accepting()

    def consume(self, token: int) -> None:
        """Move past ``token``; ``ValueError`` where the grammar did not allow it."""
        if not self.matcher.consume_token(token):
            raise ValueError(
                f"token {token} breaks the response format: {self.matcher.get_error().splitlines()[0]}"
            )


class GrammarMask(LogitsProcessor):
    """Scores of the tokens :class:`Grammar` does not allow next set to -inf."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        allowed = self.grammar.allowed(scores.shape[-1]).to(scores.device)
        return scores.masked_fill(~allowed, float("-inf"))
