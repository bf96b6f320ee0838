"""GGUF RoPE variants through llama.cpp's real converter: our logits against transformers' (the truth).

Small random transformers checkpoints of each RoPE variant (Llama plain and with Llama 3.2's llama3
scaling, linear scaling, Qwen2 with Qwen2.5's YaRN keys, Phi-3 long-rope, a partial-rotary Phi-3, Qwen3
with head size 64), with SmolLM2's tokenizer, are converted to F32 GGUFs by ``convert_hf_to_gguf.py``
from the llama.cpp source folder given, then next-token logits over English text are compared with
transformers on the original checkpoint: ``load_model(gguf, weights="float")`` as it is ("after"), the
same with the config as transformers alone reads it from the file ("before": no
``selfextend.models.gguf_rope``), and llama.cpp on the same file where ``llama_cpp`` imports.

    .venv/bin/python experiments/quality/gguf_rope_check.py /path/to/llama.cpp [--tokens 600]

Prints one row per variant (max abs logit diff / argmax agreement) and writes
``experiments/quality/results/gguf_rope_check.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import transformers as tf

HERE = Path(__file__).resolve().parent
SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
LLAMA32 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def variants(vocab: int) -> dict[str, Callable[[], torch.nn.Module]]:
    """name -> a freshly seeded random model (built lazily by the caller, one at a time)."""
    base = dict(SMALL, vocab_size=vocab, initializer_range=0.15)
    return {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**base, max_position_embeddings=2048)),
        "llama3 (Llama 3.2 scaling)": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(**base, head_dim=64, max_position_embeddings=131072, rope_parameters=LLAMA32)
        ),
        "linear x4": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(
                **base,
                max_position_embeddings=1024,
                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
            )
        ),
        "qwen2 yarn (Qwen2.5 128k)": lambda: tf.Qwen2ForCausalLM(
            tf.Qwen2Config(
                **base,
                max_position_embeddings=131072,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 1000000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                },
            )
        ),
        "phi3 longrope": lambda: tf.Phi3ForCausalLM(
            tf.Phi3Config(
                **base,
                max_position_embeddings=4096,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0 + 0.05 * i for i in range(8)],
                    "long_factor": [1.0 + 1.5 * i for i in range(8)],
                    "original_max_position_embeddings": 256,
                },
            )
        ),
        "phi3 partial rotary 0.5": lambda: tf.Phi3ForCausalLM(
            tf.Phi3Config(
                **base,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            )
        ),
        "qwen3 head size 64": lambda: tf.Qwen3ForCausalLM(
            tf.Qwen3Config(**base, head_dim=64, max_position_embeddings=2048)
        ),
    }


# Runs the converter as it is, except that a BPE pre-tokenizer it does not recognise (SmolLM2's tokenizer as
# transformers re-saves it hashes differently from the original) is taken as SmolLM2's, and a family that
# reads a SentencePiece tokenizer.model (Gemma 1 and 2) reads the folder's BPE tokenizer where it has none:
# the tokenizer does not touch the tensors or the RoPE keys checked.
_RUNNER = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "smollm"
base.TextModel.get_vocab_base_pre = pre
sentencepiece = base.TextModel._set_vocab_sentencepiece
def vocab(self, *args, **kwargs):
    if not (self.dir_model / "tokenizer.model").is_file():
        return self._set_vocab_gpt2()
    return sentencepiece(self, *args, **kwargs)
base.TextModel._set_vocab_sentencepiece = vocab
script = sys.argv[2]
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def convert(llama_cpp: Path, model_dir: Path, out: Path, outtype: str = "f32") -> None:
    """``convert_hf_to_gguf.py`` of ``llama_cpp`` on ``model_dir`` into ``out`` (``--outtype``)."""
    env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
    script = str(llama_cpp / "convert_hf_to_gguf.py")
    cmd = [sys.executable, "-c", _RUNNER, str(llama_cpp), script, str(model_dir), "--outfile", str(out)]
    done = subprocess.run([*cmd, "--outtype", outtype], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    return {
        "max_abs_diff": float((got - want).abs().max()),
        "argmax_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
    }


def ours(gguf: Path, ids: torch.Tensor, file_rope: bool) -> torch.Tensor:
    """``load_model(gguf, weights="float")``'s logits, in a fresh cache; without ``file_rope`` the config is
    transformers' reading of the file alone (as before selfextend.models.gguf_rope)."""
    from selfextend.models import gguf_rope, load_model

    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {"SELFEXTEND_CACHE": cache}):
        patch = mock.patch.object(gguf_rope, "apply_gguf_rope", lambda *a, **k: None)
        if file_rope:
            model, _ = load_model(str(gguf), weights="float")
        else:
            with patch:
                model, _ = load_model(str(gguf), weights="float")
        with torch.no_grad():
            return model(ids).logits[0]


def llama_cpp_logits(gguf: Path, ids: torch.Tensor) -> torch.Tensor | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(str(gguf), n_ctx=ids.shape[1] + 8, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids[0].tolist())
    return torch.tensor(llm.scores[: ids.shape[1]])


def cell(r: dict | None) -> str:
    """A comparison as a table cell: max abs logit diff / argmax agreement, "fails" or "-"."""
    if r is None:
        return "-"
    if "error" in r:
        return "fails"
    return f"{r['max_abs_diff']:.3g} / {100 * r['argmax_agreement']:.1f}%"


def write_rows(out: Path, rows: list[dict]) -> None:
    """The rows as JSON lines into ``out`` (replaced)."""
    out.parent.mkdir(exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "llama_cpp", type=Path, help="llama.cpp source folder (convert_hf_to_gguf.py, gguf-py)"
    )
    parser.add_argument("--tokens", type=int, default=600)
    args = parser.parse_args()

    from selfextend.evaluation.corpus import default_books
    from selfextend.models import ensure_converted, resolve_model

    tokenizer = tf.AutoTokenizer.from_pretrained(ensure_converted(resolve_model("smollm2-135m")))
    text = next(iter(default_books().values()))
    ids = torch.tensor([tokenizer(text[: 8 * args.tokens]).input_ids[: args.tokens]])
    rows = []
    print(f"{'variant':28} {'before: diff / argmax':>24} {'after: diff / argmax':>24} {'llama.cpp':>20}")
    for name, build in variants(len(tokenizer)).items():
        torch.manual_seed(0)
        model = build().eval()
        with torch.no_grad():
            truth = model(ids).logits[0]
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            tokenizer.save_pretrained(d)
            if model.config.model_type == "phi3":  # the converter's Phi-3 reads a BPE vocabulary as Phi-4's
                config_file = Path(d) / "tokenizer_config.json"
                saved = json.loads(config_file.read_text())
                config_file.write_text(json.dumps({**saved, "tokenizer_class": "GPT2Tokenizer"}))
            gguf = Path(d) / "model-f32.gguf"
            convert(args.llama_cpp, Path(d), gguf)
            row = {"variant": name, "tokens": ids.shape[1]}
            for label, file_rope in (("before", False), ("after", True)):
                try:
                    row[label] = compare(ours(gguf, ids, file_rope), truth)
                except Exception as exc:  # "before" fails outright for some variants (head size)
                    row[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
            found = llama_cpp_logits(gguf, ids)
            row["llama.cpp"] = None if found is None else compare(found, truth)
        rows.append(row)

        print(
            f"{name:28} {cell(row['before']):>24} {cell(row['after']):>24} {cell(row['llama.cpp']):>20}",
            flush=True,
        )
    write_rows(HERE / "results" / "gguf_rope_check.jsonl", rows)


if __name__ == "__main__":
    main()
