"""RoPE read from a GGUF as llama.cpp reads it: each variant, written as llama.cpp's converter writes it
(tests/gguf_write.py), loaded with ``load_model(path, weights="float")`` and compared with transformers on
the original checkpoint: the forward, the direct decode step through context shifts, Self-Extend, the
converted model read back from the cache, and the prompt cache's fingerprint. Files written by llama.cpp's
converter itself, not our writer: test_gguf_converted.py."""

from __future__ import annotations

import math
from pathlib import Path

import gguf_write
import numpy as np
import pytest
import torch
import transformers as tf
from conftest import COMMON, TRAINED, make_model
from test_decode import decoded_against_original

import selfextend
from selfextend.core.rope import find_rotary_embedding
from selfextend.kv.promptcache import fingerprint
from selfextend.models import ModelError, load_model
from selfextend.models.gguf_rope import GGUFRope, apply_gguf_rope, llama3_parameters

TOL = 1e-4
LONG = 4 * TRAINED


def _phi3_longrope() -> torch.nn.Module:
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 10.0, 12.0],
        "original_max_position_embeddings": TRAINED,
    }
    return tf.Phi3ForCausalLM(
        tf.Phi3Config(**{**COMMON, "max_position_embeddings": LONG}, rope_parameters=rope)
    )


def _qwen2_yarn() -> torch.nn.Module:
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": TRAINED,
    }
    return tf.Qwen2ForCausalLM(
        tf.Qwen2Config(**{**COMMON, "max_position_embeddings": LONG}, rope_parameters=rope)
    )


def _llama3_real_shape() -> torch.nn.Module:
    """Llama 3.2's scaling (factor 32, theta 500k, window 8192) on a tiny model with its head size 64."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = tf.LlamaConfig(
        **{**COMMON, "max_position_embeddings": 131072, "num_attention_heads": 2}, rope_parameters=rope
    )
    return tf.LlamaForCausalLM(config)


def _plain_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The same Llama (weights, window) with plain RoPE of the same base."""
    config = model.config.to_dict()
    config["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": config["rope_parameters"]["rope_theta"],
    }
    plain = tf.LlamaForCausalLM(tf.LlamaConfig.from_dict(config)).eval()
    plain.load_state_dict(model.state_dict())
    return plain


VARIANTS = {
    "llama": lambda: make_model("llama"),
    "llama3": lambda: make_model("llama", rope="llama3"),
    "llama3-32": _llama3_real_shape,
    "linear": lambda: make_model("llama", rope="linear"),
    "qwen2-yarn": _qwen2_yarn,
    "phi3-partial": lambda: make_model("phi3"),
    "phi3-longrope": _phi3_longrope,
    "qwen3-head64": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=64)),
}
IDS = torch.randint(3, 97, (1, 90), generator=torch.Generator().manual_seed(5))  # past TRAINED (64)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Each variant's original model (seeded) and its GGUF."""
    d = tmp_path_factory.mktemp("rope")
    out = {}
    for name, build in VARIANTS.items():
        torch.manual_seed(0)
        model = build().eval()
        out[name] = model, gguf_write.write(model, model.config, d / f"{name}.gguf")
    return out


def _logits(model: torch.nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_forward_equals_the_original(pairs, name):
    """The GGUF's forward against transformers on the original checkpoint, converted and read back from
    the cache (its config.json keeps the rotation)."""
    original, path = pairs[name]
    want = _logits(original)
    for _ in range(2):  # converted, then from the cache
        model, _tok = load_model(str(path), weights="float")
        assert (_logits(model) - want).abs().max() < TOL
    assert torch.equal(find_rotary_embedding(model).inv_freq, find_rotary_embedding(original).inv_freq)


@pytest.mark.parametrize("name", ["llama3", "linear", "qwen2-yarn", "phi3-partial", "qwen3-head64"])
@pytest.mark.parametrize("self_extend", [False, True])
def test_decode_step_through_shifts_equals_the_original(pairs, name, self_extend):
    """The direct decode step of the GGUF's model through context shifts (keys re-rotated by the file's
    frequencies, without YaRN's attention factor), with and without Self-Extend, against the original's
    forward over the same cache."""
    original, path = pairs[name]
    model, _tok = load_model(str(path), weights="float")
    assert decoded_against_original(model, original, IDS[0, :70].tolist(), self_extend) < TOL


def test_self_extend_on_llama3_uses_the_files_frequencies(pairs):
    """Self-Extend on a Llama-3-scaled GGUF: its grouped positions rotate with the llama3 frequencies, as on
    the transformers model patched the same way, and not with the plain ones of the same base."""
    original, path = pairs["llama3"]
    model, _tok = load_model(str(path), weights="float")
    plain = _plain_twin(original)
    with selfextend.self_extend(original, 4, 16), selfextend.self_extend(model, 4, 16):
        with selfextend.self_extend(plain, 4, 16):
            want, got, other = _logits(original), _logits(model), _logits(plain)
            freq = model.model.layers[0].self_attn.self_extend.inv_freq
            assert torch.equal(freq, original.model.layers[0].self_attn.self_extend.inv_freq)
    assert (got - want).abs().max() < TOL
    assert (other - want).abs().max() > 100 * TOL  # the frequencies matter at these positions


def test_prompt_cache_fingerprint_follows_the_frequencies(pairs, tmp_path):
    """The same weights with plain RoPE in the file: another fingerprint."""
    original, path = pairs["llama3"]
    model, _tok = load_model(str(path), weights="float")
    plain = _plain_twin(original)
    other, _tok = load_model(
        str(gguf_write.write(plain, plain.config, tmp_path / "plain.gguf")), weights="float"
    )
    assert fingerprint(model) != fingerprint(other)


def test_llama3_parameters_are_recovered_from_the_divisors():
    """Llama 3.1's and 3.2's divisors (as the converter writes them) give their parameters back; divisors
    that are not llama3's give None."""
    for factor in (8.0, 32.0):
        config = tf.LlamaConfig(
            hidden_size=2048,
            num_attention_heads=32,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
        found = llama3_parameters(gguf_write.llama3_factors(config), 500000.0, 64)
        assert found == {**config.rope_parameters, "factor": factor}
    rng = np.random.default_rng(0)
    assert llama3_parameters(rng.uniform(1, 8, 32).astype(np.float32), 500000.0, 64) is None


def test_other_divisors_divide_each_frequency():
    """A ``rope_freqs`` not of llama3's form: each inverse frequency divided by its divisor (llama.cpp's)."""
    divisors = np.linspace(1.0, 3.0, 8, dtype=np.float32)
    config = tf.LlamaConfig(**COMMON)
    apply_gguf_rope(config, GGUFRope({"rope.freq_base": 10000.0}, {"rope_freqs.weight": divisors}))
    loaded = tf.LlamaForCausalLM(config).model.rotary_emb.inv_freq
    want = 1.0 / (torch.from_numpy(divisors) * 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.allclose(loaded, want, rtol=1e-6, atol=0)


def test_yarn_attention_factor_as_llama_cpp():
    """YaRN's attention factor: 0.1 ln(factor) + 1, times the file's rope.scaling.attn_factor."""
    config = tf.Qwen2Config(**COMMON)
    keys = {
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 32,
        "rope.scaling.attn_factor": 0.5,
    }
    apply_gguf_rope(config, GGUFRope(keys))
    assert config.rope_parameters["attention_factor"] == pytest.approx(0.5 * (0.1 * math.log(4.0) + 1))
    assert config.rope_parameters["original_max_position_embeddings"] == 32


def test_value_heads_of_another_size_are_refused():
    config = tf.Qwen3Config(**COMMON)
    with pytest.raises(ModelError, match="value heads of 32 values and key heads of 16"):
        apply_gguf_rope(config, GGUFRope({"attention.key_length": 16, "attention.value_length": 32}))
