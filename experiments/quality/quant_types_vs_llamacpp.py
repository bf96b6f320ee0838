"""Each GGUF block type held as stored, on files written by llama.cpp's own quantizer: ours against llama.cpp.

The shipped SmolLM2-135M (a Q4_1 GGUF) is requantized by ``llama_cpp.llama_model_quantize`` (with
``allow_requantize``) to each type, then next-token logits over English text (the first book of the
default corpus) are compared with llama.cpp's on the same file: mean KL(llama.cpp || ours) over the
positions and argmax agreement, for ``load_model(file, weights="auto")`` (gguf on the CPU, the CLI
default). Beside it, each engine's distance from the file's own values in float (``weights="float"``:
the blocks dequantized, float activations): KL(float || llama.cpp) and KL(float || ours), so a gap
between the two engines reads against what each loses to its integer activations. And llama.cpp with
float32 K/V cells instead of its float16 default: KL(that || ours) and KL(llama.cpp || that), how far
llama.cpp moves from itself when only its attention's precision changes. Our activation blocks are
llama.cpp's (its Q8_0 / Q8_1 / Q8_K, bit for bit), yet the int8 rounding turns any last-bit difference
upstream into whole steps, so over 30 layers the two engines' roundings come apart: Q4_1 KL 0.0041
against llama.cpp, 0.0042 between llama.cpp's float16 and float32 cells (docs/generate.md).
Also the bytes the model holds for its matrices (every 2-D weight, the embedding table and a tied head
once) against the file's 2-D tensors, and the types the file holds: SmolLM2's 576 columns are no whole
super-blocks of 256, so a K-quant file falls back to 32-value types on most tensors (llama.cpp's choice).

    .venv/bin/python experiments/quality/quant_types_vs_llamacpp.py [--tokens 500] [--types Q2_K,IQ4_XS]
    # the 256-wide twin (experiments/tools/widen_to_256.py), every type:
    .venv/bin/python experiments/quality/quant_types_vs_llamacpp.py \
        --source dev-models/smollm2-135m-w768-f32.gguf \
        --types Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0,Q4_1,Q5_1,Q2_K,Q3_K_M,IQ4_NL,IQ4_XS,F16,BF16

Prints one row per type and writes ``experiments/quality/results/quant_types_vs_llamacpp.jsonl``.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import tempfile
from pathlib import Path

import torch

# llama.cpp's file types (llama.h's LLAMA_FTYPE_MOSTLY_*); Q4_1: the shipped file's own, the baseline
FTYPES = {"Q4_1": 3, "F16": 1, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32}
MORE_FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "Q4_0": 2}  # by name in --types


def quantize(src: Path, dst: Path, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to file type {ftype}")


def file_types(path: Path) -> tuple[dict[str, int], int]:
    """The file's 2-D tensors counted by type, and their bytes."""
    from gguf import GGUFReader

    counts: collections.Counter[str] = collections.Counter()
    size = 0
    for t in GGUFReader(str(path)).tensors:
        if len(t.shape) == 2:
            counts[t.tensor_type.name] += 1
            size += int(t.n_bytes)
    return dict(counts), size


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes of every 2-D (and int8 scale) weight the model holds, each storage once."""
    seen, total = set(), 0
    for _, t in [*model.named_parameters(), *model.named_buffers()]:
        key = t.untyped_storage().data_ptr()
        if t.dim() >= 1 and t.numel() > 4096 and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def llama_cpp_logits(path: Path, ids: torch.Tensor, f32_cells: bool = False) -> torch.Tensor:
    """llama.cpp's logits at every position, with its defaults (float16 K and V cells) or float32 cells."""
    from llama_cpp import Llama

    cells = {"type_k": 0, "type_v": 0} if f32_cells else {}  # GGML_TYPE_F32
    llm = Llama(str(path), n_ctx=ids.shape[1] + 8, logits_all=True, verbose=False, n_threads=2, **cells)
    llm.eval(ids[0].tolist())
    return torch.tensor(llm.scores[: ids.shape[1]])


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position, from logits (positions, vocab)."""
    p = torch.log_softmax(p_logits, -1)
    return (p.exp() * (p - torch.log_softmax(q_logits, -1))).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--types", default=",".join(FTYPES))
    parser.add_argument(
        "--source",
        type=Path,
        help="a GGUF to quantize (default: the shipped SmolLM2), e.g. the "
        "256-wide twin of experiments/tools/widen_to_256.py; results then go to a file named after it",
    )
    parser.add_argument("--out", type=Path, help="the results file (default: named after the source)")
    args = parser.parse_args()

    from selfextend.evaluation.corpus import default_books
    from selfextend.models import load_model, resolve_model
    from selfextend.models.quantize import weight_format

    source = args.source or resolve_model("smollm2-135m").gguf_path
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SELFEXTEND_CACHE"] = str(Path(tmp) / "cache")  # no conversion left in the user's cache
        for name in args.types.split(","):
            path = Path(tmp) / f"smollm2-{name}.gguf"
            quantize(source, path, {**FTYPES, **MORE_FTYPES}[name])
            model, tokenizer = load_model(str(path), weights="auto")  # gguf on the CPU
            text = next(iter(default_books().values()))
            ids = torch.tensor([tokenizer(text[: 8 * args.tokens]).input_ids[: args.tokens]])
            with torch.no_grad():
                ours = model(ids).logits[0].float()
            theirs = llama_cpp_logits(path, ids)
            kl = _kl(theirs, ours)
            f32_cells = llama_cpp_logits(path, ids, f32_cells=True)
            exact, _ = load_model(str(path), weights="float")  # the file's values, float activations
            with torch.no_grad():
                truth = exact(ids).logits[0].float()
            del exact
            types, stored = file_types(path)
            row = {
                "type": name,
                "file_types": types,
                "weights": weight_format(model),
                "kl_mean": float(kl.mean()),
                "argmax_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
                "kl_f32_cells": float(_kl(f32_cells, ours).mean()),
                "kl_llamacpp_f32_cells": float(_kl(theirs, f32_cells).mean()),
                "argmax_f32_cells": float((ours.argmax(-1) == f32_cells.argmax(-1)).float().mean()),
                "kl_float_llamacpp": float(_kl(truth, theirs).mean()),
                "argmax_float_llamacpp": float((truth.argmax(-1) == theirs.argmax(-1)).float().mean()),
                "kl_float_ours": float(_kl(truth, ours).mean()),
                "argmax_float_ours": float((truth.argmax(-1) == ours.argmax(-1)).float().mean()),
                "file_matrix_bytes": stored,
                "held_bytes": held_bytes(model),
                "positions": ids.shape[1],
            }
            row["held_over_file"] = row["held_bytes"] / stored
            rows.append(row)
            print(
                f"{name:7s} KL {row['kl_mean']:.5f}  argmax {100 * row['argmax_agreement']:.1f}%  "
                f"(float32 cells: {row['kl_f32_cells']:.5f} / {100 * row['argmax_f32_cells']:.1f}%; "
                f"llama.cpp against itself with them {row['kl_llamacpp_f32_cells']:.5f})  "
                f"from float: llama.cpp {row['kl_float_llamacpp']:.5f} "
                f"/ {100 * row['argmax_float_llamacpp']:.1f}%, "
                f"ours {row['kl_float_ours']:.5f} / {100 * row['argmax_float_ours']:.1f}%  "
                f"held {row['held_bytes'] / 1e6:.1f} MB / file {stored / 1e6:.1f} MB = "
                f"{row['held_over_file']:.3f}  {types}",
                flush=True,
            )
            del model
    out = args.out or (
        Path(__file__).parent
        / "results"
        / f"quant_types_vs_llamacpp{'-' + args.source.stem if args.source else ''}.jsonl"
    )
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
