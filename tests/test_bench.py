"""``selfextend bench`` runs every case side by side and writes records the plot command can draw."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from selfextend.cli.main import main
from selfextend.evaluation.results import read_jsonl


def test_bench_records_and_plot(tiny_dir, tmp_path):
    out = tmp_path / "bench.jsonl"
    args = [
        "bench",
        "--model",
        str(tiny_dir),
        "--lengths",
        "64,128",
        "--decode-lengths",
        "96",
        "-g",
        "2",
        "-w",
        "32",
        "--repeats",
        "1",
        "--ctx",
        "64",
        "--endless-tokens",
        "40",
        "-o",
        str(out),
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.stderr
    records = read_jsonl(out)
    runs = [x for x in records if not x.get("summary")]
    prefill = {(x["variant"], x["length"]) for x in runs if x["case"] == "prefill"}
    assert prefill == {(v, n) for v in ("plain", "selfextend", "reference") for n in (64, 128)}
    assert all(x["seconds"] > 0 and x["peak_mib"] >= 0 for x in runs if x["case"] == "prefill")
    assert {x["variant"] for x in runs if x["case"] == "decode"} == {"plain", "selfextend"}
    endless = [x for x in runs if x["case"] == "endless" and x["variant"] == "shift"]
    assert endless and endless[0]["shifts"] >= 1
    generate = {x["variant"]: x for x in runs if x["case"] == "generate"}
    assert set(generate) == {"float", "int8", "int8+selfextend"}  # no GGUF here: no llama.cpp
    assert all(x["tokens_per_s"] > 0 and x["shifts"] >= 1 for x in generate.values())
    summary = [x for x in records if x.get("summary")]
    assert any("ratio" in x for x in summary if x["case"] == "prefill")
    assert "ratio: to plain" in r.stdout
    png = tmp_path / "bench.png"
    assert CliRunner().invoke(main, ["plot", str(out), "-o", str(png)]).exit_code == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_bad_case(tiny_dir):
    r = CliRunner().invoke(main, ["bench", "--model", str(tiny_dir), "--cases", "warp"])
    assert r.exit_code != 0 and "unknown case" in r.stderr


@pytest.mark.real
def test_llama_cpp_yardstick_shifts_and_decodes():
    pytest.importorskip("llama_cpp")
    from selfextend.bench.llamacpp import LlamaCppGenerator
    from selfextend.models import resolve_model

    llama = LlamaCppGenerator(resolve_model("smollm2-135m").gguf_path, n_ctx=64, n_keep=4, threads=1)
    assert llama.tokens_per_second(list(range(1000, 1040)), 60) > 0
    assert llama.shifts >= 2 and llama.llm.n_tokens <= 64


def test_bench_generate_bandwidth_and_first_token(tiny_dir, tmp_path):
    """Generate rows carry the bytes a token reads and the rate they are read at; first-token rows time a
    prompt per length; the machine's read bandwidth is printed beside them."""
    from selfextend.bench.runner import average_fill
    from selfextend.bench.speed import bytes_per_token
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models import load_model

    out = tmp_path / "bench.jsonl"
    args = ["bench", "--model", str(tiny_dir), "--cases", "generate,first-token", "--lengths", "64,96"]
    args += ["-g", "2", "-w", "32", "--repeats", "2", "--ctx", "64", "--endless-tokens", "20"]
    r = CliRunner().invoke(main, [*args, "--cache-type", "bf16", "-o", str(out)])

    assert r.exit_code == 0, r.stderr
    runs = [x for x in read_jsonl(out) if not x.get("summary")]
    first = {(x["variant"], x["length"]) for x in runs if x["case"] == "first-token"}
    assert first == {("int8+selfextend", 64), ("int8+selfextend", 96)}
    generate = [x for x in runs if x["case"] == "generate"]
    model, _ = load_model(str(tiny_dir))
    weights = sum(t.numel() * 4 for t in (*model.parameters(), *model.buffers()))  # tied head: all read
    float_mb = [x["mb_per_token"] for x in generate if x["variant"] == "float"]
    fill = average_fill(64, 4)
    cells = bytes_per_token(model, ContextShiftCache(model, 64, 4, dtype=torch.bfloat16), fill) - weights
    assert cells == 2 * 2 * model.config.num_hidden_layers * fill * model.config.hidden_size // 2  # K+V, bf16
    assert float_mb and all(abs(mb - (weights + cells) / 1e6) < 1e-9 for mb in float_mb)
    assert all(x["gb_per_s"] == x["mb_per_token"] * x["tokens_per_s"] / 1e3 for x in generate)
    assert "machine read bandwidth" in r.stdout and "GB/s" in r.stdout
