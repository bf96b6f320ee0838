"""Malformed GGUFs never make the native kernels read or write out of bounds (issue 49, item 1).

From one small valid file (:func:`test_models.write_tiny_gguf`, Q8_0, 2 layers), a few hundred variants are
made deterministically by editing its bytes where gguf's own reader says each field lies: the file cut
short (in its header, metadata, tensor table and data), each tensor's dimensions swapped (the same byte
count, the wrong shape), halved, doubled, zero, not whole blocks, huge or overflowing int64, its type and
offset changed (onto the next tensor's data, off the file's alignment), and the metadata lying
(feed-forward length, KV and query heads, width, layers, vocabulary size, trained window, special token
ids past the token list, a name that is not UTF-8); and the issue's own case, a token list of 4M entries
over a table of 8 rows, written whole.

Each is loaded as a conversion loads it (:func:`~selfextend.models.gguf.read_gguf`, then the tensors into
``--weights gguf`` layers), then, if it loads, run: a forward over three tokens and a decode step through
the native kernels. Cases run in a child process (several to a process, restarted after a crash), so a
signal is seen as a negative exit status, not the end of pytest. Every case must be refused with a
:class:`ModelError` whose line names the tensor or key at fault (a cut file: "truncated"), or load and
compute: no signal, no other exception.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from test_models import write_tiny_gguf

from selfextend.native.quant import quant_kernels

pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernels")
HIDDEN, HEADS, KV_HEADS = 64, 4, 2
Q4_0, F32, F16 = 2, 0, 1


def _bytes(dims: list[int], kind: int) -> int:
    """The bytes a tensor of ``dims`` takes in type ``kind``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    return int(np.prod(dims)) // per_block * block_bytes


WORKER = r"""
import json, sys, traceback
import torch
torch.set_num_threads(1)
from selfextend.generation.generator import Generator
from selfextend.hf.facts import ModelError, check_rope
from selfextend.kv.cache import ContextShiftCache
from selfextend.models.diskcache import _convert_gguf
from selfextend.models.gguf import read_gguf
from selfextend.models.weights import RunForm
from pathlib import Path

for line in sys.stdin:
    i, path = json.loads(line)
    try:
        table, config = read_gguf(Path(path))
        check_rope(config, path)
        model = _convert_gguf(Path(path), config, RunForm("gguf", torch.float32), table)
    except ModelError as exc:
        out = {"outcome": "refused", "message": str(exc)}
    except Exception as exc:
        out = {"outcome": "error", "message": f"{type(exc).__name__}: {exc}"}
    else:
        try:
            with torch.no_grad():
                vocab = model.get_input_embeddings().num_embeddings
                model(torch.tensor([[1, 5 % vocab, vocab - 1]]))
                gen = Generator(model, ContextShiftCache(model, n_ctx=32, n_keep=2))
                gen.feed([1, 2 % vocab, 3 % vocab])
                gen.write([vocab - 1])
            out = {"outcome": "computed", "message": ""}
        except Exception as exc:
            out = {"outcome": "compute error", "message": f"{type(exc).__name__}: {exc}"}
    print(json.dumps({"i": i, **out}), flush=True)
"""


def _layout(path: Path) -> tuple[dict, list[dict], int]:
    """Where the base file's fields lie: {key: offset of its value}, per tensor its name, entry offsets
    (dims, type, offset), dims, type, data offset and bytes; and the data section's start."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    keys = {}
    for name, field in reader.fields.items():
        at = field.offset + 8 + len(name.encode()) + 4  # key length, key, value type
        keys[name] = at
    tensors = []
    for t in reader.tensors:
        at = t.field.offset + 8 + len(t.name.encode())
        n_dims = int(np.frombuffer(reader.data[at : at + 4], np.uint32)[0])
        tensors.append(
            {
                "name": t.name,
                "dims_at": at + 4,
                "type_at": at + 4 + 8 * n_dims,
                "offset_at": at + 4 + 8 * n_dims + 4,
                "dims": [int(d) for d in t.shape],
                "type": int(t.tensor_type),
                "end": t.data_offset + t.n_bytes,
                "data": t.data_offset,
            }
        )
    return keys, tensors, min(t["data"] for t in tensors)


def _put(data: bytes, at: int, value: int, fmt: str) -> bytes:
    raw = np.array([value], dtype=fmt).tobytes()
    return data[:at] + raw + data[at + len(raw) :]


def variants(base: Path) -> list[tuple[str, bytes, tuple[str, ...], bool]]:
    """(label, file bytes, substrings one of which a refusal must name, whether it must be refused)."""
    data = base.read_bytes()
    keys, tensors, start = _layout(base)
    out = []
    for cut in sorted({int(len(data) * f) for f in np.linspace(0.0005, 0.999, 40)}):
        cut_in = next((t["name"] for t in tensors if t["end"] > cut), None) if cut > start else None
        names = (cut_in,) if cut_in else ("truncated", "not a GGUF")
        out.append((f"cut at {cut}", data[:cut], names, True))
    for t in tensors:
        name, dims = t["name"], t["dims"]
        two = len(dims) == 2

        def dims_to(new: list[int], t: dict = t) -> bytes:
            edited = data
            for k, n in enumerate(new):
                edited = _put(edited, t["dims_at"] + 8 * k, n, "<u8")
            return edited

        cases = {
            "zero": [0, *dims[1:]],
            "huge": [dims[0], *([1 << 62] if two else [])] if two else [1 << 62],
            "overflowing int64": [32 << 32, *([1 << 32] if two else [])] if two else [(1 << 64) - 32],
            "not whole blocks": [dims[0] + 1, *dims[1:]],
            "wider": [2 * dims[0], *dims[1:]],
        }
        if two:
            cases |= {
                "swapped": dims[::-1],
                "half the rows": [dims[0], dims[1] // 2],
                "twice": [dims[0], 2 * dims[1]],
            }
        for label, new in cases.items():
            out.append((f"{name} {label} {new}", dims_to(new), (name,), new != dims))
        last = t["data"] == max(u["data"] for u in tensors)  # no tensor after it to find it wrong
        for kind in (Q4_0, F32, F16, 99):
            # a type of other bytes is refused (one of fewer left a gap, read as garbage) unless the last
            must = kind == 99 or (not last and _bytes(dims, kind) != t["end"] - t["data"])
            out.append((f"{name} type {kind}", _put(data, t["type_at"], kind, "<u4"), (name,), must))
        moved = t["data"] - start
        for offset, must in ((moved + 32, True), (moved + 2, True), (1 << 63, True), (len(data), True)):
            edited = _put(data, t["offset_at"], offset, "<u8")
            out.append((f"{name} offset {offset}", edited, (name,), must))
    lies = {
        "llama.feed_forward_length": ((64, 256, 0, 1 << 31), ("ffn_", "feed_forward_length")),
        "llama.attention.head_count_kv": ((1, 4, 3, 0), ("attn_k", "attn_v", "head")),
        "llama.attention.head_count": ((2, 8, 0), ("attn_q", "attn_output", "head", "rope")),
        "llama.embedding_length": ((32, 128), ("token_embd", "attn", "norm", "head")),
        "llama.block_count": ((3, 0), ("tensor blk.2.", "block_count")),  # in the file's names
        "llama.vocab_size": ((8, 300, 4_000_000), ("token_embd", "vocab_size")),
        "llama.context_length": ((0,), ("context_length",)),
        "tokenizer.ggml.bos_token_id": ((262, 99_999), ("bos_token_id",)),
        "tokenizer.ggml.eos_token_id": ((4_000_000_000,), ("eos_token_id",)),
        "tokenizer.ggml.padding_token_id": ((1 << 31,), ("padding_token_id",)),
    }
    for key, (values, names) in lies.items():
        for value in values:
            out.append((f"{key} = {value}", _put(data, keys[key], value, "<u4"), names, True))
    name_at = keys["general.name"] + 8  # the string's bytes, after its length
    not_utf8 = data[:name_at] + b"\xff\xfe" + data[name_at + 2 :]
    out.append(("general.name not UTF-8", not_utf8, ("general.name",), True))
    return out


def _four_million_tokens(path: Path) -> Path:
    """The issue's file: a token list of 4M entries over a token_embd of 8 rows (Q8_0)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(HIDDEN)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(4_000_000)])
    values = np.random.default_rng(0).standard_normal((8, HIDDEN)).astype(np.float32)
    kind = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def run_cases(paths: list[Path]) -> list[dict]:
    """Each path loaded by the worker, in order; a worker killed by a signal has that case recorded as the
    signal and is started again on the next case."""
    results: list[dict] = []
    while len(results) < len(paths):
        todo = "".join(json.dumps([i, str(p)]) + "\n" for i, p in enumerate(paths) if i >= len(results))
        proc = subprocess.run(
            [sys.executable, "-c", WORKER], input=todo, capture_output=True, text=True, timeout=600
        )
        results += [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if len(results) < len(paths):  # the worker died on the next case
            results.append(
                {"i": len(results), "outcome": f"signal {-proc.returncode}", "message": proc.stderr[-300:]}
            )
    return results


def test_malformed_ggufs_are_refused_by_name_never_a_signal(tmp_path: Path) -> None:
    base = write_tiny_gguf(
        tmp_path / "base.gguf", hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, quant="Q8_0"
    )
    cases = [("valid base", base.read_bytes(), (), False), *variants(base)]
    paths = []
    for i, (_, data, _, _) in enumerate(cases):
        paths.append(tmp_path / f"case{i:03d}.gguf")
        paths[-1].write_bytes(data)
    cases.append(("4M tokens over 8 rows", b"", ("tokenizer.ggml.tokens",), True))
    paths.append(_four_million_tokens(tmp_path / "four-million.gguf"))
    results = run_cases(paths)
    counts = Counter(r["outcome"] for r in results)
    print(f"{len(cases)} cases: {dict(counts)}")
    assert len(cases) >= 200
    bad = []
    for (label, _, names, must), result in zip(cases, results, strict=True):
        outcome, message = result["outcome"], result["message"]
        if outcome == "computed" and not must:
            continue
        if outcome == "refused" and "\n" not in message and any(n in message for n in names):
            continue
        bad.append(f"{label}: {outcome}: {message}")
    assert not bad, f"{len(bad)} of {len(cases)} cases:\n" + "\n".join(bad[:40])
    assert results[0]["outcome"] == "computed" and results[-1]["outcome"] == "refused"
    assert "4000000" in results[-1]["message"] and "8 rows" in results[-1]["message"]
