"""experiments/tools/widen_to_256.py: a Llama GGUF zero-padded to widths that are multiples of 256 computes
the same function. Oracle: transformers on the original (unwidened) checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import gguf_write
import pytest
import torch
from conftest import COMMON
from transformers import LlamaConfig, LlamaForCausalLM

from selfextend.models import load_model

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "tools" / "widen_to_256.py"
IDS = torch.tensor([[1, *range(5, 40), 7, 9, 11, 13]])


def _script():
    spec = importlib.util.spec_from_file_location("widen_to_256", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_widened_twin_computes_the_original(tmp_path: Path, tied: bool) -> None:
    """Hidden 96 (3 heads of 32, one kv head: a GQA group of 3) -> 768 with 24 heads and 8 kv heads, the
    feed-forward 200 -> 256; norms with random weights and an eps near the activations' scale, so a wrong
    eps or norm scale shows; every matrix's input width a multiple of 256 afterwards."""
    config = LlamaConfig(
        **{
            **COMMON,
            "hidden_size": 96,
            "intermediate_size": 200,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
        },
        rms_norm_eps=0.05,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    original = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in original.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    source = gguf_write.write(original, config, tmp_path / "tiny.gguf")
    twin = tmp_path / "wide.gguf"
    shape = _script().widen(source, twin)
    assert shape == {"hidden": 768, "heads": 24, "kv_heads": 8, "ffn": 256, "head_dim": 32}

    reader = gguf.GGUFReader(str(twin))
    widths = {t.name: int(t.shape[0]) for t in reader.tensors if len(t.shape) == 2}
    assert ("output.weight" in widths) is not tied
    assert all(w % 256 == 0 for w in widths.values()), widths
    model, _ = load_model(str(twin), weights="float")
    assert model.config.hidden_size == 768
    with torch.no_grad():
        truth, ours = original(IDS).logits[0], model(IDS).logits[0]
    torch.testing.assert_close(ours, truth, rtol=1e-5, atol=1e-5)
    assert (ours.argmax(-1) == truth.argmax(-1)).all()


def test_an_unknown_tensor_is_refused() -> None:
    """A tensor the widening does not know (a bias) raises instead of being copied into another function."""
    import numpy as np

    shape = {"hidden": 96, "heads": 3, "kv_heads": 1, "ffn": 200, "head_dim": 32}
    with pytest.raises(ValueError, match="attn_q.bias"):
        _script().widen_tensor("blk.0.attn_q.bias", np.zeros(96, np.float32), shape, shape)
