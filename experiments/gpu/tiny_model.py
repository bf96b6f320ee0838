"""A tiny random Llama with the default model's tokenizer and chat template, saved as a model folder: what
the GPU checks run the CLI's commands on (a GPU machine cannot convert the default GGUF: no gguf there).

    python experiments/gpu/tiny_model.py DIR
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from selfextend.models import ensure_converted, resolve_model


def main(out: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(ensure_converted(resolve_model("smollm2-135m")))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.15,  # sharp attention: positions matter
    )
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1])
