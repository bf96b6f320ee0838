"""Widen a Llama-architecture GGUF, zero-padded, to widths that are multiples of 256: the same function, but
every matrix's input width a whole number of K-quant super-blocks (issue 40).

The shipped SmolLM2-135M has 576 columns, so llama.cpp's quantizer sends a K-quant or IQ4_XS file back to
32-value types (Q4_0, Q5_0, Q5_1, IQ4_NL) on most tensors. This writes an exact twin with the model's real
weights (the shipped file's blocks dequantized), widened so each type is stored in its own blocks:

- hidden 576 -> 768 (the least multiple of 256 that holds whole GQA groups of heads): the embedding's and
  q/k/v/gate/up's extra input columns are zero, o_proj's and down_proj's extra output rows are zero, so the
  residual stream's extra dimensions stay 0 through every layer;
- heads 9 -> 12 and kv heads 3 -> 4 (the group of 3 kept: q heads 9-11 read the new kv head 3), all zero, so
  their attention output is zero (a softmax-weighted mean of zero values) and o_proj's input is 768 wide.
  llama.cpp's converter permutes q/k rows within each head only, so zero heads appended after the last are
  the same rows before or after that permutation;
- the feed-forward width padded too when it is not a multiple of 256 (SmolLM2's 1536 already is);
- RMSNorm over H' = 768 dims of which 576 are nonzero: mean'(x^2) = (H/H') mean(x^2), so with
  eps' = eps * H/H' the denominator is sqrt(H/H') * sqrt(mean(x^2) + eps) exactly, and a weight
  w' = w * sqrt(H/H') (zero on the extra dims) gives x * w' / sqrt(mean'(x^2) + eps') = x * w / sqrt(mean(x^2)
  + eps). The file's ``layer_norm_rms_epsilon`` is eps'.

The tokenizer and every other key are copied from the source; ``general.file_type`` says F32 (or F16).
Tensors are streamed one at a time. ``--check`` then loads both files with ``load_model(path,
weights="float")`` and compares next-token logits over 200 tokens of the default corpus (max abs
difference, argmax agreement), and runs llama.cpp (llama-cpp-python) on the twin against the same truth.

    python experiments/tools/widen_to_256.py --check                 # SmolLM2-135M -> dev-models/...-w768-f32
    python experiments/tools/widen_to_256.py --source FILE.gguf --out twin.gguf --dtype F16

Measured (SmolLM2-135M, F32 twin, 200 tokens): see ``experiments/tools/results/widen_to_256.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import gguf
import numpy as np

DEFAULT_OUT = Path("dev-models")  # relative: under the folder the script runs from
BLOCK = 256  # a K-quant super-block
ARCH = "llama"
NORMS = ("attn_norm", "ffn_norm", "output_norm")


def widths(hidden: int, heads: int, kv_heads: int, ffn: int) -> tuple[int, int, int, int]:
    """The twin's hidden width, heads, kv heads and feed-forward width: the least multiples of 256 that
    keep the head size and the GQA group (hidden a multiple of head size x group)."""
    head_dim, group = hidden // heads, heads // kv_heads
    step = math.lcm(BLOCK, head_dim * group)
    wide = -(-hidden // step) * step
    return wide, wide // head_dim, wide // head_dim // group, -(-ffn // BLOCK) * BLOCK


def _pad(a: np.ndarray, rows: int, cols: int | None = None) -> np.ndarray:
    """``a`` (rows0[, cols0]) zero-padded at the end to (rows[, cols])."""
    if a.ndim == 1:
        return np.pad(a, (0, rows - a.shape[0]))
    return np.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def widen_tensor(name: str, a: np.ndarray, old: dict[str, int], new: dict[str, int]) -> np.ndarray:
    """One tensor of the twin from the source's (rows, cols) float32 values; a tensor it does not know
    raises ValueError rather than being copied unchanged into a different function."""
    h, f, q, kv = new["hidden"], new["ffn"], new["heads"] * new["head_dim"], new["kv_heads"] * new["head_dim"]
    kind = name.removesuffix(".weight").split(".")[-1]
    if kind in NORMS:
        return _pad(a * np.float32(math.sqrt(old["hidden"] / h)), h)
    shapes = {  # (rows, cols) of each matrix in the twin
        "token_embd": (a.shape[0], h),
        "output": (a.shape[0], h),
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, q),
        "ffn_gate": (f, h),
        "ffn_up": (f, h),
        "ffn_down": (h, f),
    }
    if kind == "rope_freqs":
        return a
    if kind not in shapes or a.ndim != 2 or not name.endswith(".weight"):
        raise ValueError(f"{name}: not a tensor this widening knows (llama architecture, no biases)")
    return _pad(a, *shapes[kind])


def _source_shape(reader: gguf.GGUFReader) -> dict[str, int]:
    value = lambda key: reader.fields[f"{ARCH}.{key}"].contents()  # noqa: E731
    arch = reader.fields["general.architecture"].contents()
    if arch != ARCH:
        raise ValueError(f"architecture {arch!r}: only {ARCH!r} files are widened")
    shape = {
        "hidden": value("embedding_length"),
        "heads": value("attention.head_count"),
        "kv_heads": value("attention.head_count_kv"),
        "ffn": value("feed_forward_length"),
        "eps": value("attention.layer_norm_rms_epsilon"),
    }
    shape["head_dim"] = shape["hidden"] // shape["heads"]
    for key in (
        "attention.key_length",
        "attention.value_length",
    ):  # the converter writes them; kept as they are
        if f"{ARCH}.{key}" in reader.fields and value(key) != shape["head_dim"]:
            raise ValueError(f"{key} {value(key)}: a head size other than hidden / heads is not handled")
    return shape


def widen(source: Path, out: Path, dtype: str = "F32") -> dict[str, int]:
    """Write the widened twin of ``source`` to ``out`` (F32 or F16 values); returns the new shape."""
    reader = gguf.GGUFReader(str(source))
    old = _source_shape(reader)
    wide, heads, kv_heads, ffn = widths(old["hidden"], old["heads"], old["kv_heads"], old["ffn"])
    new = {"hidden": wide, "heads": heads, "kv_heads": kv_heads, "ffn": ffn, "head_dim": old["head_dim"]}
    new_keys = {
        f"{ARCH}.embedding_length": wide,
        f"{ARCH}.attention.head_count": heads,
        f"{ARCH}.attention.head_count_kv": kv_heads,
        f"{ARCH}.feed_forward_length": ffn,
        f"{ARCH}.attention.layer_norm_rms_epsilon": old["eps"] * old["hidden"] / wide,
        "general.file_type": int(
            gguf.LlamaFileType.ALL_F32 if dtype == "F32" else gguf.LlamaFileType.MOSTLY_F16
        ),
    }
    if "general.name" in reader.fields:
        new_keys["general.name"] = f"{reader.fields['general.name'].contents()} w{wide}"
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), ARCH)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value = new_keys.get(field.name, field.contents())
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)

    def values(t: gguf.ReaderTensor) -> np.ndarray:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        a = widen_tensor(t.name, a, old, new)
        return a if a.ndim == 1 or dtype == "F32" else a.astype(np.float16)  # norms stay F32, as converted

    for t in reader.tensors:  # shapes first (header), then the data one tensor at a time
        a = values(t)
        writer.add_tensor_info(t.name, a.shape, a.dtype, a.nbytes)
    writer.write_header_to_file(str(out))
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(values(t))
    writer.close()
    return new


def _logits(path: Path, ids: list[int]) -> np.ndarray:
    import torch

    from selfextend.models import load_model

    model, _ = load_model(str(path), weights="float")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _llama_cpp_logits(path: Path, ids: list[int], cache_type: int) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(
        str(path),
        n_ctx=len(ids) + 8,
        logits_all=True,
        verbose=False,
        n_threads=2,
        type_k=cache_type,
        type_v=cache_type,
    )
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def check(source: Path, twin: Path, tokens: int = 200) -> dict[str, float]:
    """The twin's logits against the source's (both ``weights="float"``), and llama.cpp's on the twin."""
    from selfextend.evaluation.corpus import default_books
    from selfextend.models import load_model

    _, tokenizer = load_model(str(source), weights="float")
    text = next(iter(default_books().values()))
    ids = tokenizer(text[: 8 * tokens]).input_ids[:tokens]
    truth, ours = _logits(source, ids), _logits(twin, ids)
    theirs = _llama_cpp_logits(twin, ids, 1)  # llama.cpp's default F16 cache
    theirs32 = _llama_cpp_logits(twin, ids, 0)  # F32 cache: its float matrices alone
    agree = lambda a: float((a.argmax(-1) == truth.argmax(-1)).mean())  # noqa: E731
    return {
        "positions": len(ids),
        "max_abs_diff": float(np.abs(ours - truth).max()),
        "logit_scale": float(np.abs(truth).max()),
        "argmax_agreement": agree(ours),
        "llama_cpp_max_abs_diff": float(np.abs(theirs - truth).max()),
        "llama_cpp_argmax_agreement": agree(theirs),
        "llama_cpp_f32_cache_max_abs_diff": float(np.abs(theirs32 - truth).max()),
        "llama_cpp_f32_cache_argmax_agreement": agree(theirs32),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, help="a llama GGUF (default: the shipped SmolLM2-135M)")
    parser.add_argument("--out", type=Path, help="default: dev-models/<name>-w<width>-<dtype>.gguf")
    parser.add_argument("--dtype", choices=("F32", "F16"), default="F32")
    parser.add_argument("--check", action="store_true", help="compare the twin's logits with the source's")
    args = parser.parse_args()
    if args.source is None:
        from selfextend.models import resolve_model

        found = resolve_model("smollm2-135m")
        args.source, name = Path(found.location) / found.gguf_file, "smollm2-135m"
    else:
        name = args.source.stem
    reader = gguf.GGUFReader(str(args.source))
    old = _source_shape(reader)
    wide = widths(old["hidden"], old["heads"], old["kv_heads"], old["ffn"])[0]
    out = args.out or DEFAULT_OUT / f"{name}-w{wide}-{args.dtype.lower()}.gguf"
    new = widen(args.source, out, args.dtype)
    print(f"{out}: {old} -> {new}", flush=True)
    if args.check:
        result = {"source": str(args.source), "twin": str(out), "shape": new, **check(args.source, out)}
        print(json.dumps(result, indent=1))
        dest = Path(__file__).parent / "results" / "widen_to_256.json"
        dest.parent.mkdir(exist_ok=True)
        dest.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
