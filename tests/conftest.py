"""Tiny randomly initialised models of each supported family: no download, float32."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)


def pytest_configure(config: pytest.Config) -> None:
    """Every model conversion of the session goes into a temporary cache (inherited by subprocesses and by
    pytest-xdist's workers, which share the one their controller made), never into the user's own
    ``~/.cache/selfextend``."""
    if hasattr(config, "workerinput"):  # an xdist worker: its controller's cache is in the environment
        return
    config.selfextend_cache = tempfile.mkdtemp(prefix="selfextend-test-cache-")
    os.environ["SELFEXTEND_CACHE"] = config.selfextend_cache


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "selfextend_cache"):
        shutil.rmtree(config.selfextend_cache, ignore_errors=True)


TRAINED = 64  # max_position_embeddings of the tiny models
COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=TRAINED,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.15,  # sharper attention than the default 0.02, so positions matter
)


def _llama(**overrides):
    return lambda: LlamaForCausalLM(LlamaConfig(**{**COMMON, **overrides}))


FAMILIES = {
    "llama": _llama(),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16)),
    "phi3": lambda: Phi3ForCausalLM(
        Phi3Config(
            **COMMON,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
    ),
    "gemma": lambda: GemmaForCausalLM(GemmaConfig(**COMMON, head_dim=16)),
}

ROPE_TYPES = {
    "default": {},
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": TRAINED,
        }
    },
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": TRAINED,
        }
    },
}


GEMMA3_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}


def tiny_gemma3(layer_types: list[str], sliding_window: int, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random Gemma 3: sliding layers with RoPE base 10k, full ones with base 1M, as the real model."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": len(layer_types), **overrides},
        head_dim=16,
        layer_types=layer_types,
        sliding_window=sliding_window,
        rope_parameters=GEMMA3_ROPE,
        query_pre_attn_scalar=16,
    )
    return Gemma3ForCausalLM(config).eval()


def make_model(family: str = "llama", seed: int = 0, rope: str = "default") -> torch.nn.Module:
    torch.manual_seed(seed)
    if rope == "default":
        return FAMILIES[family]().eval()
    extra = {"max_position_embeddings": 4 * TRAINED} if rope in ("llama3", "yarn") else {}
    factory = _llama(**ROPE_TYPES[rope], **extra)
    return factory().eval()


@pytest.fixture(params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


def real_vocab_config(vocab_size: int, **overrides) -> LlamaConfig:
    """A tiny Llama for the default model's tokenizer (its vocabulary and chat template)."""
    config = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return LlamaConfig(**{**config, **overrides})


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    from selfextend.models import ensure_converted, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_converted(resolve_model("smollm2-135m")))
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(real_vocab_config(len(tokenizer))).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """(the tiny model of ``tiny_dir``, its tokenizer): a Llama with the default model's vocabulary."""
    from transformers import AutoTokenizer

    model = LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(autouse=True)
def _no_default_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands decode eagerly unless a test asks for ``--compile`` (also in the commands tests start as
    processes): compiling takes minutes on two cores and writes inductor's cache (test_compiled.py
    compiles on purpose, into a tmp folder)."""
    monkeypatch.setenv("SELFEXTEND_COMPILE", "0")
