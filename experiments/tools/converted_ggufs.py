"""The suite's GGUFs written by llama.cpp's own converter (``tests/data/converted/``, read by
``tests/test_gguf_converted.py``), and transformers' logits on the checkpoints they came from.

One tiny random transformers checkpoint per family and RoPE variant (weights rounded to float16, so the F16
file holds them exactly), with one byte-level BPE tokenizer of 128 tokens trained here (the tokenizer is
not what is tested: the ids are given), is converted to an F16 GGUF by ``convert_hf_to_gguf.py`` of the
llama.cpp source folder given (as ``experiments/quality/gguf_rope_check.py`` runs it), and transformers'
logits on the original checkpoint over one fixed sequence of token ids, at every 4th position, go into
``expected.safetensors`` beside the files. ``gemma3-27b`` has 62 layers and a query scale of
1/sqrt(hidden/heads) that is not 1/sqrt(head size): llama.cpp's rule for the 27B shape, which the
converter writes no key for.

    .venv/bin/python experiments/tools/converted_ggufs.py /path/to/llama.cpp

(``/path/to/llama.cpp``: the ``vendor/llama.cpp`` folder of the llama-cpp-python 0.3.36 sdist, which the
files in the repository were made with.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as tf
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments" / "quality"))
sys.path.insert(0, str(ROOT / "tests"))
from conftest import COMMON  # noqa: E402
from gguf_rope_check import convert  # noqa: E402

VOCAB = 128
TRAINED = 32
TOKENS = 48  # past the trained window, so the scaled RoPE variants use their long factors
ROWS = list(range(3, TOKENS, 4))  # the positions whose logits are stored
# the suite's tiny shape (tests/conftest.py's COMMON), narrower, with the converter's small vocabulary
SMALL = dict(
    COMMON,
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=32,
    max_position_embeddings=TRAINED,
    tie_word_embeddings=False,
)
GEMMA = dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=8, tie_word_embeddings=True)
# 62 layers (llama.cpp's test for the 27B shape), hidden / heads = 4 where the head size is 8
GEMMA3_27B = dict(
    num_hidden_layers=62, hidden_size=16, intermediate_size=8, num_key_value_heads=1, query_pre_attn_scalar=4
)
LONG = dict(max_position_embeddings=4 * TRAINED)
MOE = dict(num_experts_per_tok=2)
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way."
)


def _rope(kind: str, **values: float) -> dict:
    return {"rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **values}}


def families() -> dict[str, Callable[[], torch.nn.Module]]:
    """name -> a freshly seeded random model (built by the caller, one at a time)."""
    b = SMALL
    longrope = _rope(
        "longrope",
        short_factor=[1.0, 1.2, 1.6, 2.0],
        long_factor=[1.0, 2.5, 6.0, 12.0],
        original_max_position_embeddings=TRAINED,
    )
    llama3 = dict(
        factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=TRAINED
    )
    llama32 = {**llama3, "factor": 32.0, "rope_theta": 500000.0, "original_max_position_embeddings": 8192}
    return {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**b)),
        "llama-llama3": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(**{**b, **LONG}, **_rope("llama3", **llama3))
        ),
        # Llama 3.2's scaling (factor 32, theta 500k, window 8192) with its head size 64
        "llama-llama3-32": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(
                **{
                    **b,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "max_position_embeddings": 131072,
                },
                head_dim=64,
                **_rope("llama3", **llama32),
            )
        ),
        "llama-linear": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(**{**b, **LONG}, **_rope("linear", factor=4.0))
        ),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**b, sliding_window=None)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**b)),
        "qwen2-yarn": lambda: tf.Qwen2ForCausalLM(
            tf.Qwen2Config(
                **{**b, **LONG}, **_rope("yarn", factor=4.0, original_max_position_embeddings=TRAINED)
            )
        ),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**b, head_dim=16)),  # head size not hidden/heads
        "phi3-partial": lambda: tf.Phi3ForCausalLM(
            tf.Phi3Config(**b, **_rope("default", partial_rotary_factor=0.5))
        ),
        "phi3-longrope": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**{**b, **LONG}, **longrope)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**{**b, **GEMMA})),
        "gemma2": lambda: tf.Gemma2ForCausalLM(
            tf.Gemma2Config(**{**b, **GEMMA}, attn_logit_softcapping=1.5, final_logit_softcapping=6.0)
        ),
        # llama.cpp's pattern (the converter writes none): five sliding layers, then one in full
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**b, **GEMMA, "num_hidden_layers": 6})),
        # the 27B shape's rule: 62 layers, queries scaled by 1/sqrt(hidden/heads) = 1/2, not 1/sqrt(8)
        "gemma3-27b": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**b, **GEMMA, **GEMMA3_27B})),
        "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(**b, partial_rotary_factor=0.25)),
        "starcoder2": lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**b, sliding_window=None)),
        "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**b)),
        "granite": lambda: tf.GraniteForCausalLM(
            tf.GraniteConfig(
                **b,
                embedding_multiplier=12.0,
                residual_multiplier=0.22,
                attention_multiplier=0.1,
                logits_scaling=8.0,
            )
        ),
        "mixtral": lambda: tf.MixtralForCausalLM(
            tf.MixtralConfig(**b, **MOE, num_local_experts=4, sliding_window=None)
        ),
        "qwen2moe": lambda: tf.Qwen2MoeForCausalLM(
            tf.Qwen2MoeConfig(
                **b, **MOE, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32
            )
        ),
        # llama.cpp always normalises the chosen experts' weights
        "qwen3moe": lambda: tf.Qwen3MoeForCausalLM(
            tf.Qwen3MoeConfig(**b, **MOE, num_experts=4, moe_intermediate_size=16, norm_topk_prob=True)
        ),
    }


def tokenizer(vocab: int = VOCAB, specials: tuple[str, ...] = ()) -> tf.PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab`` tokens trained on :data:`TEXT` (``<pad>``, ``<s>``, ``</s>`` first;
    ``<|endoftext|>``, which transformers' Qwen2 tokenizer would add past the 128 otherwise; then
    ``specials``). Of :data:`VOCAB`, only the characters of the text; with more, every byte (so any text
    has its tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    every_byte = pre_tokenizers.ByteLevel.alphabet() if vocab > VOCAB else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "<s>", "</s>", "<|endoftext|>", *specials],
        initial_alphabet=every_byte,
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    if len(fast) != vocab:
        raise RuntimeError(f"the trained tokenizer has {len(fast)} tokens, not {vocab}")
    return fast


def ids() -> torch.Tensor:
    """The token ids the stored logits are of (1, :data:`TOKENS`)."""
    return torch.randint(4, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(49))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "llama_cpp", type=Path, help="llama.cpp source folder (convert_hf_to_gguf.py, gguf-py)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "converted")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tok, x = tokenizer(), ids()
    expected = {"ids": x[0], "rows": torch.tensor(ROWS)}
    for name, build in families().items():
        torch.manual_seed(0)
        model = build().eval()
        with torch.no_grad():
            for p in model.parameters():  # float16 values, held exactly by the F16 file
                p.copy_(p.half().float())
            expected[name] = model(x).logits[0, ROWS].contiguous()
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            tok.save_pretrained(d)
            # the tokenizer as it is (a family's own class would add its special tokens to the 128); the
            # converter's Phi-3 reads a BPE vocabulary as Phi-4's
            phi3 = model.config.model_type == "phi3"
            config_file = Path(d) / "tokenizer_config.json"
            saved = json.loads(config_file.read_text())
            saved["tokenizer_class"] = "GPT2Tokenizer" if phi3 else "PreTrainedTokenizerFast"
            config_file.write_text(json.dumps(saved))
            gguf = args.out / f"{name}.gguf"
            convert(args.llama_cpp, Path(d), gguf, outtype="f16")
        print(f"{name:16} {gguf.stat().st_size / 1024:7.1f} KiB", flush=True)
    save_file(expected, str(args.out / "expected.safetensors"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
