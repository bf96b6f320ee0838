"""Tiny GGUFs written as llama.cpp's converter (``convert_hf_to_gguf.py``) writes them, with gguf's writer.

The converter cannot be installed, so tests rebuild what it writes for the families they use: the
metadata keys (``TextModel.set_gguf_parameters`` and the family's own), llama.cpp's tensor names (gguf's
tensor name map), the q/k row permutation of Llama-family models (llama.cpp's ``rope`` of "normal" type
pairs neighbouring dimensions), and the RoPE tensors and keys (``rope_freqs`` for Llama 3 scaling,
``rope_factors_long/short`` for long-rope, the ``rope.scaling.*`` keys for linear and YaRN).

``write(model_or_state_dict, config, path)`` is the whole API; :data:`ARCHES` says which families it knows
(add a family there: its gguf architecture and whether its q/k rows are permuted).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

# transformers model_type -> (gguf architecture name, q/k rows permuted as llama.cpp's LlamaModel does)
ARCHES: dict[str, tuple[str, bool]] = {
    "llama": ("llama", True),
    "mistral": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "phi3": ("phi3", False),
    "gemma": ("gemma", False),
    "gemma2": ("gemma2", False),
    "gemma3_text": ("gemma3", False),
    "stablelm": ("stablelm", False),
    "starcoder2": ("starcoder2", False),
    "olmo2": ("olmo2", False),
    "granite": ("granite", True),
    "mixtral": ("llama", True),
    "qwen2_moe": ("qwen2moe", False),
    "qwen3_moe": ("qwen3moe", False),
}

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad/unk, bos, eos


def byte_chars() -> list[str]:
    """GPT-2's byte-to-character table (the base alphabet of a byte-level BPE vocabulary)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter order of a q or k projection's rows (or bias): within each head, the two
    halves that transformers rotates together are interleaved: (heads, 2, D/2, ...) -> (heads, D/2, 2, ...).
    """
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(config: Any) -> dict[str, Any]:
    """The config's RoPE settings as the converter reads them (``rope_parameters``, else ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(params.get("full_attention", params))


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama3_factors(config: Any) -> np.ndarray:
    """The ``rope_freqs`` tensor LlamaModel.generate_extra_tensors writes for ``rope_type: llama3``."""
    rope = _rope(config)
    base, dim = rope.get("rope_theta", 10000.0), _head_dim(config)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _metadata(writer: Any, config: Any, arch: str, vocab: int) -> dict[str, np.ndarray]:
    """Write the converter's metadata keys; return the extra RoPE tensors it generates."""
    rope, head_dim = _rope(config), _head_dim(config)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    _family_metadata(writer, config, arch)
    extra: dict[str, np.ndarray] = {}
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        orig = rope.get("original_max_position_embeddings") or config.max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(orig)
        rot = int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size) // config.num_attention_heads
        writer.add_rope_dimension_count(rot)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(getattr(config, "sliding_window", None) or 0)
        if rope.get("long_factor"):
            scale = config.max_position_embeddings / orig
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
            )
            extra["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
            extra["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
        return extra
    import gguf

    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif kind == "llama3" and arch == "llama":
        extra["rope_freqs.weight"] = llama3_factors(config)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if getattr(config, "head_dim", None) is not None:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch == "llama":
        writer.add_vocab_size(vocab)
        writer.add_rope_dimension_count(head_dim)
    return extra


def _tokenizer(writer: Any, vocab: int) -> None:
    """A byte-level BPE vocabulary of ``vocab`` tokens (the specials, byte characters, one merge)."""
    chars = byte_chars()
    tokens = SPECIALS + [chars[i % 256] * (1 + i // 256) for i in range(vocab - len(SPECIALS) - 1)]
    tokens.append(chars[0] + chars[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
    writer.add_token_merges([f"{chars[0]} {chars[1]}"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)


def write(
    model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor],
    config: Any,
    path: str | Path,
    arch: str | None = None,
    file_type: str = "F32",
    types: dict[str, str] | None = None,
) -> Path:
    """Write a transformers checkpoint (a model, or its state dict with its ``config``) to ``path`` as
    llama.cpp's converter would; ``file_type`` F32, F16, BF16 or Q8_0 (matrices; 1-D tensors stay F32);
    ``types``: another type gguf quantizes for the matrices of some kinds (``{"attn_v": "Q4_0"}``: a
    Q4_K_M file's v projection differs from its q and k).

    ``arch`` is the gguf architecture (default from :data:`ARCHES` by ``config.model_type``).
    """
    import gguf

    state = model_or_state_dict
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    name, permuted = ARCHES[config.model_type]
    arch = arch or name
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    kind = gguf.GGMLQuantizationType[file_type]
    ftype = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16}
    ftype["BF16"] = gguf.LlamaFileType.MOSTLY_BF16
    ftype["Q8_0"] = gguf.LlamaFileType.MOSTLY_Q8_0

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{config.model_type}")
    extra = _metadata(writer, config, arch, config.vocab_size)
    writer.add_file_type(ftype[file_type])
    _tokenizer(writer, config.vocab_size)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue  # tied: safetensors holds the embedding only
        t = tensor.detach().float()
        if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute_qk(t, config.num_attention_heads)
        if permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute_qk(t, kv_heads)
        for gguf_name, values in _family_tensors(hf_name, t, arch, names):
            own = next((t for part, t in (types or {}).items() if gguf_name.split(".")[-2] == part), None)
            matrix_kind = gguf.GGMLQuantizationType[own] if own else kind
            if values.ndim >= 2 and matrix_kind != gguf.GGMLQuantizationType.F32:
                writer.add_tensor(gguf_name, gguf.quants.quantize(values, matrix_kind), raw_dtype=matrix_kind)
            else:
                writer.add_tensor(gguf_name, np.ascontiguousarray(values, dtype=np.float32))
    for gguf_name, values in extra.items():
        writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _family_metadata(writer: Any, config: Any, arch: str) -> None:
    """The norm epsilon and each family's own keys (its converter class's ``set_gguf_parameters``)."""
    if getattr(config, "rms_norm_eps", None) is not None:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    else:  # StableLM, Starcoder2: LayerNorm
        writer.add_layer_norm_eps(getattr(config, "layer_norm_eps", None) or config.norm_epsilon)
    if arch == "stablelm":
        rot = int(_rope(config).get("partial_rotary_factor", 1.0) * _head_dim(config))
        writer.add_rope_dimension_count(rot)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
        if getattr(config, "attn_logit_softcapping", None) is not None:
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if getattr(config, "final_logit_softcapping", None) is not None:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        sliding = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention")
        if sliding:
            writer.add_rope_freq_base_swa(sliding["rope_theta"])
    if arch == "granite":
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _family_tensors(hf_name: str, t: torch.Tensor, arch: str, names: Any) -> list[tuple[str, np.ndarray]]:
    """One checkpoint tensor as the converter stores it: Gemma's norms as ``1 + weight``, transformers'
    fused experts (E, 2I, H) split into the gate and up stacks (E, I, H) each."""
    if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
        t = t + 1
    if hf_name.endswith("mlp.experts.gate_up_proj"):
        block = hf_name.split(".")[2]
        half = t.shape[1] // 2
        return [
            (f"blk.{block}.ffn_gate_exps.weight", t[:, :half].numpy()),
            (f"blk.{block}.ffn_up_exps.weight", t[:, half:].numpy()),
        ]
    gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise KeyError(f"no llama.cpp name for {hf_name} in {arch}")
    if not gguf_name.endswith((".weight", ".bias")):  # a fused expert stack: a parameter without suffix
        gguf_name += ".weight"
    return [(gguf_name, t.numpy())]
