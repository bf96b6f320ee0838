"""GGUFs written by llama.cpp's own converter, not by our writer (``tests/gguf_write.py`` shares the
reader's assumptions): one tiny random checkpoint per family and RoPE variant, converted to F16 by
``convert_hf_to_gguf.py`` of the llama-cpp-python 0.3.36 sdist and stored in ``tests/data/converted/``
with transformers' logits on the original checkpoints (``expected.safetensors``: fixed token ids, every
4th position). Made by

    .venv/bin/python experiments/tools/converted_ggufs.py /path/to/llama_cpp_python-0.3.36/vendor/llama.cpp

Oracle: those stored logits (the checkpoints' weights are float16 values, which the F16 files hold
exactly). ``gemma3-27b`` has the 27B shape's 62 layers and a query scale of 1/sqrt(hidden/heads) (1/2)
that is not 1/sqrt(head size) (1/sqrt(8)): llama.cpp's rule, for which the converter writes no key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_gguf_families import FAMILIES
from test_gguf_rope import VARIANTS

from selfextend.models import load_model

DATA = Path(__file__).parent / "data" / "converted"
EXPECTED = load_file(str(DATA / "expected.safetensors"))
NAMES = sorted(p.stem for p in DATA.glob("*.gguf"))
TOL = 1e-4
# our writer's RoPE variants (test_gguf_rope.py) -> the converted file of the same variant
ROPE = {
    "llama": "llama",
    "llama3": "llama-llama3",
    "llama3-32": "llama-llama3-32",
    "linear": "llama-linear",
    "qwen2-yarn": "qwen2-yarn",
    "phi3-partial": "phi3-partial",
    "phi3-longrope": "phi3-longrope",
    "qwen3-head64": "qwen3",  # a head size (16) that is not hidden / heads (8)
}


def test_every_family_and_variant_has_a_converted_file():
    """Each family of test_gguf_families.py and each RoPE variant of test_gguf_rope.py, and the 27B
    Gemma 3 shape, has a converter-made file with its expected logits."""
    wanted = {*(f if f != "phi3" else "phi3-partial" for f in FAMILIES), *(ROPE[v] for v in VARIANTS)}
    wanted.add("gemma3-27b")
    assert wanted <= set(NAMES)
    assert set(NAMES) <= set(EXPECTED)


@pytest.mark.parametrize("name", NAMES)
def test_forward_equals_transformers_on_the_original(name):
    model, _ = load_model(str(DATA / f"{name}.gguf"), weights="float")
    with torch.no_grad():
        logits = model(EXPECTED["ids"][None]).logits[0, EXPECTED["rows"]]
    assert (logits - EXPECTED[name]).abs().max() < TOL


def test_gemma3_27b_takes_llama_cpps_query_scale():
    """The 62-layer Gemma 3 reads its query scale as llama.cpp does: hidden / heads (16 / 4), not the
    head size (8), which the file does hold."""
    model, _ = load_model(str(DATA / "gemma3-27b.gguf"), weights="float")
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (62, 16, 4)
    assert (config.head_dim, config.query_pre_attn_scalar) == (8, 4)
