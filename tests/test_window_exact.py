"""A neighbor window at least the input length is the plain model, bit for bit, through decoding.

With every key inside the window Self-Extend's attention is plain attention, so prefill and every
decode step must run the same operations in the same precision as the unpatched model. Equal up to
rounding is not enough: int8 weights round activations to bfloat16 before each product, which turns
a last-bit difference in attention into a different greedy token a few dozen tokens later. The oracle
is the unpatched model itself.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TRAINED, make_model, tiny_gemma3
from torch import nn

import selfextend
from selfextend.generation.generator import Generator
from selfextend.kv.cache import ContextShiftCache
from selfextend.models.quantize import quantize_int8


def greedy(model: nn.Module, ids: list[int], n: int, n_ctx: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after ``ids`` and the logits each one was picked from (n, vocab)."""
    gen = Generator(model, ContextShiftCache(model, n_ctx=n_ctx))
    logits = gen.feed(ids)
    tokens, seen = [], []
    for _ in range(n):
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        logits = gen.feed([tokens[-1]])
    assert gen.cache.shifts == 0
    return tokens, torch.stack(seen)


def with_and_without(model: nn.Module, ids: list[int], n: int, window: int, n_ctx: int):
    plain = greedy(model, ids, n, n_ctx)
    with selfextend.self_extend(model, group_size=4, window=window):
        extended = greedy(model, ids, n, n_ctx)
    return plain, extended


MODELS = {
    "llama": lambda: make_model("llama"),  # the direct decode step
    "qwen2": lambda: make_model("qwen2"),
    "qwen3": lambda: make_model("qwen3"),  # the model's forward
    "phi3": lambda: make_model("phi3"),
    "gemma3": lambda: tiny_gemma3(["sliding_attention", "full_attention"], sliding_window=16),
}


@pytest.mark.parametrize("weights", ["float", "int8"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_window_covering_the_input_is_the_plain_model(name, weights):
    model = MODELS[name]()
    if weights == "int8":
        quantize_int8(model)
    ids = torch.randint(3, 97, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    (tokens, logits), (se_tokens, se_logits) = with_and_without(model, ids, 40, TRAINED - 4, TRAINED)
    assert se_tokens == tokens
    assert torch.equal(se_logits, logits)


@pytest.mark.real
@pytest.mark.parametrize("weights", ["float", "int8"])
def test_default_model_greedy_tokens_equal_with_a_covering_window(weights):
    """The README's exactness claim on SmolLM2, in the weight forms ``generate`` offers."""
    from selfextend.models import load_model

    model, tokenizer = load_model(weights=weights)
    ids = tokenizer("The history of the lighthouse begins").input_ids
    (tokens, logits), (se_tokens, se_logits) = with_and_without(model, ids, 40, 1024, 2048)
    assert tokenizer.decode(se_tokens) == tokenizer.decode(tokens)
    assert torch.equal(se_logits, logits)
