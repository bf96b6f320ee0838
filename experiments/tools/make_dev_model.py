"""Make the 1B-class development models of issue 27: the real shapes of Llama-3.2-1B and Qwen2.5-1.5B with
seeded synthetic weights, written as an F16 GGUF and quantized by llama.cpp's own quantizer to Q4_0 and
Q4_K_M, so the block mix (Q4_K with Q6_K for some attn_v / ffn_down layers and the output head) is what
real ``_M`` files hold.

Speed depends on shapes and block types, not on values, so these stand in for the real models, which no
machine here can download. Weights are normal with a small std (activations stay finite through every
layer), norms are ones. The tokenizer is SmolLM2's (from the shipped GGUF) padded with ``[PAD<i>]`` tokens
of type UNUSED up to the vocabulary size, as llama.cpp's converter pads vocabularies; both llama.cpp and
transformers' GGUF loader read it. Llama 3's ``llama3`` RoPE scaling is left out: llama.cpp reads it as a
``rope_freqs`` tensor but transformers' GGUF loader ignores that tensor, so the two would disagree about
the model; plain RoPE with theta 500000 is what both load. The Qwen2.5-1.5B shape has an untied output
head, as issue 27 asks (a tied one reads about the same bytes per token).

Measured (seed 0): llama-3.2-1b Q4_K_M 0.80 GB {F32: 33, Q4_K: 96, Q6_K: 17} (half the attn_v and ffn_down
layers and the tied embedding/head in Q6_K, as in real files), Q4_0 0.77 GB {F32: 33, Q4_0: 112, Q6_K: 1}.

    python experiments/tools/make_dev_model.py                      # both shapes, F16 + Q4_0 + Q4_K_M
    python experiments/tools/make_dev_model.py --shape llama-3.2-1b --types Q4_K_M --out /tmp/models

Files go into ``dev-models/`` under the folder it is run from (``--out``); ``llama-quantize`` is taken from
the PATH (``--quantizer``), else llama-cpp-python's copy of the same code. Files are reproducible (fixed
seed, no timestamps): the same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from selfextend.models.sources import resolve_model

DEFAULT_OUT = Path("dev-models")  # relative: under the folder the script runs from
STD = 0.02


@dataclass(frozen=True)
class Shape:
    """A model's public config values, as its GGUF metadata states them."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    theta: float
    eps: float
    context: int
    tied: bool
    qkv_bias: bool


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, 500000.0, 1e-5, 131072, True, False),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 128, 8960, 151936, 1e6, 1e-6, 32768, False, True),
}


def tensor_shapes(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's GGUF name and numpy shape (rows = outputs), in llama.cpp's converter order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [("token_embd.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s.hidden,))]
        out += [(b + "attn_q.weight", (q, s.hidden)), (b + "attn_k.weight", (kv, s.hidden))]
        out += [(b + "attn_v.weight", (kv, s.hidden))]
        if s.qkv_bias:
            out += [(b + "attn_q.bias", (q,)), (b + "attn_k.bias", (kv,)), (b + "attn_v.bias", (kv,))]
        out += [(b + "attn_output.weight", (s.hidden, q)), (b + "ffn_norm.weight", (s.hidden,))]
        out += [(b + "ffn_gate.weight", (s.ffn, s.hidden)), (b + "ffn_up.weight", (s.ffn, s.hidden))]
        out += [(b + "ffn_down.weight", (s.hidden, s.ffn))]
    out += [("output_norm.weight", (s.hidden,))]
    if not s.tied:
        out += [("output.weight", (s.vocab, s.hidden))]
    return out


def synthetic(name: str, shape: tuple[int, ...], seed: int, index: int) -> np.ndarray:
    """One tensor's values: norms ones (F32), biases and matrices seeded normal (biases F32, matrices F16),
    drawn in fixed row chunks from a generator seeded by (seed, index) so memory stays at one F16 copy."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    rng = np.random.default_rng([seed, index])
    if len(shape) == 1:
        return (rng.standard_normal(shape, dtype=np.float32) * STD).astype(np.float32)
    out = np.empty(shape, dtype=np.float16)
    for r in range(0, shape[0], 8192):
        chunk = rng.standard_normal((min(8192, shape[0] - r), shape[1]), dtype=np.float32)
        out[r : r + len(chunk)] = chunk * STD
    return out


def copy_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """SmolLM2's tokenizer fields, its token list padded with UNUSED ``[PAD<i>]`` tokens to ``vocab``."""
    reader = gguf.GGUFReader(resolve_model("smollm2-135m").gguf_path)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)


def write_f16(name: str, s: Shape, path: Path, seed: int) -> None:
    """Stream the F16 GGUF of shape ``s`` to ``path``, one tensor in memory at a time."""
    writer = gguf.GGUFWriter(path, s.arch)
    writer.add_name(f"selfextend synthetic {name} (seed {seed})")
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_freq_base(s.theta)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_layer_norm_rms_eps(s.eps)
    writer.add_vocab_size(s.vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(writer, s.vocab)
    shapes = tensor_shapes(s)
    for tname, shape in shapes:
        dtype = np.float32 if len(shape) == 1 else np.float16
        writer.add_tensor_info(tname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (tname, shape) in enumerate(shapes):
        writer.write_tensor_data(synthetic(tname, shape, seed, i))
    writer.close()


def quantize(src: Path, dst: Path, qtype: str, quantizer: Path | None) -> None:
    """``src`` -> ``dst`` in ``qtype`` by llama.cpp's quantizer: the ``llama-quantize`` binary if it
    exists, else ``llama_model_quantize`` from llama-cpp-python (the same code)."""
    if quantizer is not None and quantizer.exists():
        subprocess.run([str(quantizer), str(src), str(dst), qtype, "2"], check=True, capture_output=True)
        return
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src}")


def type_counts(path: Path) -> dict[str, int]:
    """How many tensors of each block type ``path`` holds."""
    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return dict(sorted(counts.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    ap.add_argument("--types", default="Q4_0,Q4_K_M", help="llama.cpp quantization types, comma-separated")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: ./dev-models)")
    ap.add_argument("--seed", type=int, default=0)
    found = shutil.which("llama-quantize")
    ap.add_argument("--quantizer", type=Path, default=found and Path(found), help="llama-quantize binary")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in SHAPES if args.shape == "all" else [args.shape]:
        f16 = args.out / f"{name}-synthetic-F16.gguf"
        if not f16.exists():
            tmp = f16.with_suffix(".partial")
            write_f16(name, SHAPES[name], tmp, args.seed)
            shutil.move(tmp, f16)
        print(f"{f16}: {f16.stat().st_size / 1e9:.2f} GB {type_counts(f16)}", flush=True)
        for qtype in [t.strip() for t in args.types.split(",") if t.strip()]:
            dst = args.out / f"{name}-synthetic-{qtype}.gguf"
            quantize(f16, dst, qtype, args.quantizer)
            print(f"{dst}: {dst.stat().st_size / 1e9:.2f} GB {type_counts(dst)}", flush=True)


if __name__ == "__main__":
    main()
