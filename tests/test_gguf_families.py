"""The RoPE families users run, each from a GGUF written as llama.cpp's converter writes it
(tests/gguf_write.py): logits against transformers on the original checkpoint, through the forward and the
decode step (the direct one where it serves the family, the model's forward otherwise), plain and
Self-Extend, across context shifts; the default weights (a Q8_0 file's blocks) within their rounding.
Files written by llama.cpp's converter itself, not our writer: test_gguf_converted.py."""

from __future__ import annotations

import gguf_write
import pytest
import torch
import transformers as tf
from conftest import COMMON, make_model
from test_decode import decoded_against_original, decoded_logits

import selfextend
from selfextend.generation.decode import decode_step_for
from selfextend.models import load_model
from selfextend.models.blocks import BlockLinear

TOL = 1e-4
Q8_TOL = 0.01  # Q8_0 blocks with rounded activations against their float values: mean logit difference,
# relative to the largest logit (a routed family's top-k choice may flip at a few positions)
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8)  # llama.cpp's scale: 1/sqrt(head)

FAMILIES = {
    "llama": lambda: make_model("llama"),
    "mistral": lambda: make_model("mistral"),
    "qwen2": lambda: make_model("qwen2"),
    "qwen3": lambda: make_model("qwen3"),
    "phi3": lambda: make_model("phi3"),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**COMMON, head_dim=16)),
    # soft-capping low enough to matter at these scores; layers alternate sliding, full (llama.cpp's pattern)
    "gemma2": lambda: tf.Gemma2ForCausalLM(
        tf.Gemma2Config(**COMMON, **_GEMMA, attn_logit_softcapping=1.5, final_logit_softcapping=6.0)
    ),
    # llama.cpp's pattern (the converter writes none): five sliding layers, then one in full
    "gemma3": lambda: tf.Gemma3ForCausalLM(
        tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, **_GEMMA)
    ),
    "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(**COMMON, partial_rotary_factor=0.25)),
    "starcoder2": lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**COMMON, sliding_window=None)),
    "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**COMMON)),
    "granite": lambda: tf.GraniteForCausalLM(
        tf.GraniteConfig(
            **COMMON,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.1,
            logits_scaling=8.0,
        )
    ),
    "mixtral": lambda: tf.MixtralForCausalLM(
        tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    ),
    "qwen2moe": lambda: tf.Qwen2MoeForCausalLM(
        tf.Qwen2MoeConfig(
            **COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        )
    ),
    # llama.cpp always normalises the chosen experts' weights (transformers' default does not)
    "qwen3moe": lambda: tf.Qwen3MoeForCausalLM(
        tf.Qwen3MoeConfig(
            **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        )
    ),
}
SERVED = {"llama", "mistral", "qwen2", "qwen3", "gemma3"}  # by the direct decode step
IDS = torch.randint(3, 97, (1, 90), generator=torch.Generator().manual_seed(7))  # past the trained 64


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, object, object]]:
    """Each family's original model (seeded) and its GGUF in float32 and in Q8_0."""
    d = tmp_path_factory.mktemp("families")
    out = {}
    for name, build in FAMILIES.items():
        torch.manual_seed(0)
        model = build().eval()
        f32 = gguf_write.write(model, model.config, d / f"{name}.gguf")
        q8 = gguf_write.write(model, model.config, d / f"{name}-q8.gguf", file_type="Q8_0")
        out[name] = model, f32, q8
    return out


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits[0]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_forward_equals_the_original(files, name):
    original, path, _ = files[name]
    model, _tok = load_model(str(path), weights="float")
    assert type(model) is type(original) or name == "mistral"  # a Mistral file reads as Llama: one math
    assert (_logits(model) - _logits(original)).abs().max() < TOL


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("self_extend", [False, True])
def test_decode_through_shifts_equals_the_original(files, name, self_extend):
    """Token by token through a shifting cache: the direct step where it serves the family, else the
    model's forward (never a wrong answer), against the original's forward over the same cache."""
    original, path, _ = files[name]
    model, _tok = load_model(str(path), weights="float")
    assert (decode_step_for(model) is not None) == (name in SERVED)
    assert decoded_against_original(model, original, IDS[0, :70].tolist(), self_extend) < TOL


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_default_weights_within_their_rounding(files, name):
    """The default weights of a Q8_0 file (its blocks as stored, native products) against the file's
    values in float; where the direct step serves the family, it gives the same model's forward logits."""
    _, _, path = files[name]
    model, _tok = load_model(str(path), weights="auto")
    assert any(isinstance(m, BlockLinear) for m in model.modules())
    _near(_logits(model), _logits(load_model(str(path), weights="float")[0]))
    if name in SERVED:  # the native step (its activations rounded as the kernels take them)
        ids = IDS[0, :60].tolist()
        _near(decoded_logits(model, ids, direct=True), decoded_logits(model, ids, direct=False))


def _near(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got - want).abs().mean() < Q8_TOL * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


def test_gemma2_self_extend_honours_soft_capping(files):
    """Gemma 2 under Self-Extend: with groups of 1 it is the eager forward of the original (capped scores,
    sliding layers); with groups of 3 the efficient kernel equals the full-matrix reference, and both differ
    from the uncapped scores."""
    original, path, _ = files["gemma2"]
    assert original.config._attn_implementation == "eager"
    model, _tok = load_model(str(path), weights="float")
    want = _logits(original)
    with selfextend.self_extend(model, 1, 8):
        assert (_logits(model) - want).abs().max() < TOL
    with selfextend.self_extend(model, 3, 8):
        fast = _logits(model)
    selfextend.apply_self_extend(model, 3, 8, implementation="selfextend_reference")
    try:
        assert (_logits(model) - fast).abs().max() < TOL
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        assert (_logits(model) - fast).abs().max() > 100 * TOL
    finally:
        selfextend.remove_self_extend(model)
