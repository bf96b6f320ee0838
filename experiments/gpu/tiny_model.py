"""A tiny random Llama with the default model's tokenizer and chat template, saved as a model folder: what
the GPU checks run the CLI's commands on (a GPU machine cannot convert the default GGUF: no gguf there).

    python experiments/gpu/tiny_model.py DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from selfextend.models import ensure_converted, resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import real_vocab_config  # noqa: E402  (the suite's tiny model for this tokenizer)


def main(out: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(ensure_converted(resolve_model("smollm2-135m")))
    torch.manual_seed(0)
    config = real_vocab_config(len(tokenizer), intermediate_size=128, initializer_range=0.15)  # sharp
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1])
