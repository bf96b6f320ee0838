"""Make development models with the real shapes of the models people run (issues 27 and 41): Llama-3.2-1B,
Qwen2.5-1.5B (tied head, vocabulary 151,936, q/k/v bias), Llama-3.2-3B and Llama-3.1-8B, with seeded
synthetic weights, written as an F16 GGUF and quantized by llama.cpp's own quantizer (Q4_0, Q4_K_M or any
type it names), so the block mix (Q4_K with Q6_K for some attn_v / ffn_down layers and the output head) is
what real files hold.

Speed depends on shapes and block types, not on values, so these stand in for the real models, which no
machine here can download. Weights are normal with a small std (activations stay finite through every
layer), norms are ones. The tokenizer is SmolLM2's (from the shipped GGUF) padded with ``[PAD<i>]`` tokens
of type UNUSED up to the vocabulary size, as llama.cpp's converter pads vocabularies; both llama.cpp and
transformers' GGUF loader read it. The Llama 3 shapes carry their ``llama3`` RoPE scaling as llama.cpp's
converter writes it: a ``rope_freqs.weight`` tensor (one divisor per frequency; factor 32 for 3.2, 8 for
3.1, low 1, high 4, original window 8192) and no scaling keys; llama.cpp and selfextend's loader
(``selfextend/models/gguf_rope.py``) both read it. ``qwen2.5-1.5b-untied`` is issue 27's variant with a
separate output head.

The F16 file is streamed one tensor at a time (the largest, the 8B's embedding, is 1.05 GB), so making the
8B takes little memory; it is deleted after quantizing unless ``--keep-f16`` (or F16 is a type asked for).

Measured (seed 0), Q4_K_M: qwen2.5-1.5b 0.98 GB {F32: 141, Q4_K: 168, Q6_K: 29} (the tied embedding/head,
half the attn_v and ffn_down layers in Q6_K, as in real files); llama-3.2-3b 2.02 GB {F32: 58, Q4_K: 168,
Q6_K: 29}; llama-3.1-8b 4.92 GB {F32: 66, Q4_K: 193, Q6_K: 33} (untied: the embedding in Q4_K, the head in
Q6_K), made with a peak RSS of 3.5 GB (writer and quantizer) and 16 GB of F16 on disk while it runs. Before
the ``rope_freqs`` tensor: llama-3.2-1b Q4_K_M 0.80 GB {F32: 33, Q4_K: 96, Q6_K: 17}, Q4_0 0.77 GB.

    python experiments/tools/make_dev_model.py                      # the 1B and 1.5B shapes, Q4_0 + Q4_K_M
    python experiments/tools/make_dev_model.py --shape llama-3.1-8b --types Q4_K_M --out /tmp/models

Files go into ``dev-models/`` under the folder it is run from (``--out``); ``llama-quantize`` is taken from
``--quantizer`` or the PATH, else llama-cpp-python's copy of the same code (``llama_model_quantize``).
Files are reproducible (fixed seed, no timestamps): the same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from selfextend.models.gguf_rope import _llama3_factors
from selfextend.models.sources import resolve_model

DEFAULT_OUT = Path("dev-models")  # relative: under the folder the script runs from
STD = 0.02
# llama.cpp's file types by the names its quantizer takes: Q4_K_M, IQ4_XS, F16, BF16, F32 ...
FTYPES = {
    m.name.removeprefix("MOSTLY_").removeprefix("ALL_"): m for m in gguf.LlamaFileType if m.name != "GUESSED"
}


@dataclass(frozen=True)
class Llama3Rope:
    """A ``rope_scaling`` of type ``llama3``, as the model's config.json states it."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    llama3: Llama3Rope | None = None


def _llama3(
    hidden: int, layers: int, heads: int, head_dim: int, ffn: int, tied: bool, factor: float
) -> Shape:
    """A Llama 3 shape: 8 KV heads, vocabulary 128,256, theta 500,000, 128k context, llama3 RoPE scaling."""
    values = (hidden, layers, heads, 8, head_dim, ffn, 128256, 5e5, 1e-5, 131072)
    return Shape("llama", *values, tied=tied, qkv_bias=False, llama3=Llama3Rope(factor))


QWEN_1_5B = (1536, 28, 12, 2, 128, 8960, 151936, 1e6, 1e-6, 32768)
SHAPES = {
    "llama-3.2-1b": _llama3(2048, 16, 32, 64, 8192, tied=True, factor=32.0),
    "qwen2.5-1.5b": Shape("qwen2", *QWEN_1_5B, tied=True, qkv_bias=True),
    "qwen2.5-1.5b-untied": Shape("qwen2", *QWEN_1_5B, tied=False, qkv_bias=True),
    "llama-3.2-3b": _llama3(3072, 28, 24, 128, 8192, tied=True, factor=32.0),
    "llama-3.1-8b": _llama3(4096, 32, 32, 128, 14336, tied=False, factor=8.0),
}
DEFAULT_SHAPES = "llama-3.2-1b,qwen2.5-1.5b"


def rope_freqs(s: Shape) -> np.ndarray:
    """The ``rope_freqs`` divisors llama.cpp's converter writes for ``s``'s llama3 scaling (float32)."""
    assert s.llama3 is not None
    params = {"rope_theta": s.theta, **vars(s.llama3)}
    return np.asarray(_llama3_factors(params, s.head_dim), dtype=np.float32)


def tensor_shapes(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's GGUF name and numpy shape (rows = outputs), in llama.cpp's converter order (its
    generated ``rope_freqs`` first)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [("rope_freqs.weight", (s.head_dim // 2,))] if s.llama3 else []
    out += [("token_embd.weight", (s.vocab, s.hidden))]
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
        dtype = np.dtype(np.float32 if len(shape) == 1 else np.float16)
        writer.add_tensor_info(tname, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (tname, shape) in enumerate(shapes):
        values = rope_freqs(s) if tname == "rope_freqs.weight" else synthetic(tname, shape, seed, i)
        writer.write_tensor_data(values)
    writer.close()


def quantize(src: Path, dst: Path, qtype: str, quantizer: Path | None) -> None:
    """``src`` -> ``dst`` in ``qtype`` by llama.cpp's quantizer: the ``llama-quantize`` binary if given,
    else ``llama_model_quantize`` from llama-cpp-python (the same code)."""
    if quantizer is not None:
        run = subprocess.run([str(quantizer), str(src), str(dst), qtype, "2"], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"{quantizer} failed on {src} ({qtype}):\n{run.stderr[-2000:]}")
        return
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(FTYPES[qtype])
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src} ({qtype})")


def type_counts(path: Path) -> dict[str, int]:
    """How many tensors of each block type ``path`` holds."""
    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return dict(sorted(counts.items()))


def _listed(ap: argparse.ArgumentParser, text: str, known: list[str], what: str) -> list[str]:
    """A comma-separated argument's items, each one of ``known`` (else argparse's one-line error)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in known]
    if unknown or not items:
        ap.error(f"unknown {what} {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}")
    return items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=DEFAULT_SHAPES, help=f"comma-separated, or all: {', '.join(SHAPES)}")
    ap.add_argument("--types", default="Q4_0,Q4_K_M", help="llama.cpp file types (its quantizer's names)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: ./dev-models)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 file the types are made from")
    found = shutil.which("llama-quantize")
    ap.add_argument("--quantizer", type=Path, default=found and Path(found), help="llama-quantize binary")
    args = ap.parse_args()
    names = list(SHAPES) if args.shape == "all" else _listed(ap, args.shape, list(SHAPES), "shape")
    qtypes = _listed(ap, args.types, list(FTYPES), "type")
    if args.quantizer is not None and not args.quantizer.is_file():
        ap.error(f"--quantizer {args.quantizer} is not a file")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        f16 = args.out / f"{name}-synthetic-F16.gguf"
        start = time.perf_counter()
        if not f16.exists():
            tmp = f16.with_suffix(".partial")
            write_f16(name, SHAPES[name], tmp, args.seed)
            shutil.move(tmp, f16)
        took = time.perf_counter() - start
        print(f"{f16}: {f16.stat().st_size / 1e9:.2f} GB {type_counts(f16)} ({took:.0f} s)", flush=True)
        for qtype in (q for q in qtypes if q != "F16"):
            dst = args.out / f"{name}-synthetic-{qtype}.gguf"
            start = time.perf_counter()
            quantize(f16, dst, qtype, args.quantizer)
            took = time.perf_counter() - start
            print(f"{dst}: {dst.stat().st_size / 1e9:.2f} GB {type_counts(dst)} ({took:.0f} s)", flush=True)
        if not args.keep_f16 and "F16" not in qtypes:
            f16.unlink()


if __name__ == "__main__":
    main()
