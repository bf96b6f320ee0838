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
    from selfextend.bench.speed import cpu_model  # every row names its machine: the CPU's model, threads

    threads = torch.get_num_threads()
    assert {x["device"] for x in runs} == {f"{cpu_model()}, {threads} thread{'s' * (threads != 1)}"}
    assert {(x["group_size"], x["window"]) for x in runs} == {(2, 32)}  # the settings every row ran with
    assert {x["variant"] for x in runs if x["case"] == "decode"} == {"plain", "selfextend"}
    endless = [x for x in runs if x["case"] == "endless" and x["variant"] == "shift"]
    assert endless and endless[0]["shifts"] >= 1
    generate = {x["variant"]: x for x in runs if x["case"] == "generate"}
    assert set(generate) == {"int8", "int8+selfextend"}  # no GGUF here: no int4, no llama.cpp
    assert all(x["tokens_per_s"] > 0 and x["shifts"] >= 1 for x in generate.values())
    for x in generate.values():  # the read bandwidth just before and after each timed run
        lo, hi = x["read_bandwidth_gbs"]
        assert 0 < lo <= hi
    ranges = [x["read_bandwidth_gbs"] for x in records if x.get("summary") and x["case"] == "generate"]
    assert ranges and all(len(r) == 2 and r[0] <= r[1] for r in ranges)
    assert "machine read bandwidth" in r.stdout
    summary = [x for x in records if x.get("summary")]
    assert any("ratio" in x for x in summary if x["case"] == "prefill")
    assert "ratio: to plain" in r.stdout
    png = tmp_path / "bench.png"
    assert CliRunner().invoke(main, ["plot", str(out), "-o", str(png)]).exit_code == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_bad_case(tiny_dir):
    r = CliRunner().invoke(main, ["bench", "--model", str(tiny_dir), "--cases", "warp"])
    assert r.exit_code != 0 and "unknown case" in r.stderr
    r = CliRunner().invoke(
        main, ["bench", "--model", str(tiny_dir), "--cases", "generate", "--forms", "int4,x"]
    )
    assert r.exit_code != 0 and "--forms" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.real
def test_llama_cpp_yardstick_shifts_and_decodes():
    pytest.importorskip("llama_cpp")
    from selfextend.bench.llamacpp import LlamaCppGenerator
    from selfextend.models import resolve_model

    llama = LlamaCppGenerator(resolve_model("smollm2-135m").gguf_path, n_ctx=64, n_keep=4, threads=1)
    assert llama.tokens_per_second(list(range(1000, 1040)), 60) > 0
    assert llama.shifts >= 2 and llama.llm.n_tokens <= 64


def test_prefill_warms_every_variant_up_before_timing(monkeypatch):
    from conftest import COMMON
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfextend.bench import runner

    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "vocab_size": 300})).eval()  # bench ids start at 100
    calls: list[int] = []
    forward = type(model).forward
    monkeypatch.setattr(
        type(model), "forward", lambda self, ids, **kw: calls.append(ids.shape[1]) or forward(self, ids, **kw)
    )
    cfg = runner.BenchConfig([16, 32], [16], group_size=2, window=8, repeats=1)
    records = list(runner.bench_prefill(model, cfg, runner.MemoryMeter(torch.device("cpu"))))
    assert len(records) == 6 and [r["length"] for r in records[:3]] == [16, 16, 16]
    assert calls == [16] * 3 + [16] * 3 + [32] * 3  # one untimed run per variant first


@pytest.mark.parametrize("trained", [48, 8192])
def test_bench_plot_axis_keeps_to_the_data(tmp_path, monkeypatch, trained):
    from matplotlib.figure import Figure

    from selfextend.evaluation.plot import plot_bench

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    runs = [
        {"case": "prefill", "variant": v, "length": n, "seconds": n / 100, "peak_mib": n / 10}
        for v in ("plain", "selfextend")
        for n in (32, 64)
    ]
    plot_bench(runs, tmp_path / "b.png", trained_window=trained)
    ax = saved[0].axes[0]
    named = sorted(label for line in ax.get_lines() if not (label := line.get_label()).startswith("_"))
    assert named == ["plain", "selfextend"]  # records written before G and W were kept: by variant alone
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    if trained == 48:
        assert any("trained" in t for t in ticks)
    else:
        assert ax.get_xlim()[1] < 128 and not any("trained" in t for t in ticks)
        assert "trained window 8k tokens: beyond these lengths" in ax.get_xlabel()


def test_bench_generate_bandwidth_and_first_token(tiny_dir, tmp_path):
    """Generate rows carry the bytes a token reads and the rate they are read at; first-token rows time a
    prompt per length; the machine's read bandwidth is printed beside them."""
    from selfextend.bench.runner import average_fill
    from selfextend.bench.speed import bytes_per_token, cell_bytes
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
    assert {x["variant"] for x in generate} == {
        "int8",
        "int8+selfextend",
    }  # not a GGUF: no int4, no llama.cpp
    model, _ = load_model(str(tiny_dir))
    weights = sum(t.numel() * 4 for t in (*model.parameters(), *model.buffers()))  # tied head: all read
    fill = average_fill(64, 4)
    cache = ContextShiftCache(model, 64, 4, dtype=torch.bfloat16)
    cells = 2 * 2 * model.config.num_hidden_layers * fill * model.config.hidden_size // 2  # K+V, bf16
    assert cell_bytes(cache, fill) == cells
    assert bytes_per_token(model, cache, fill) == weights + cells
    int8, _ = load_model(str(tiny_dir), weights="int8")
    int8_mb = [x["mb_per_token"] for x in generate if x["variant"] == "int8"]
    assert int8_mb and all(abs(mb - bytes_per_token(int8, cache, fill) / 1e6) < 1e-9 for mb in int8_mb)
    assert all(x["gb_per_s"] == x["mb_per_token"] * x["tokens_per_s"] / 1e3 for x in generate)
    assert "machine read bandwidth" in r.stdout and "GB/s" in r.stdout
    # each run records the weights it used (the variant's, not --weights' float), and the header says so
    assert {x["weights"] for x in runs} == {"int8"}
    assert {x["weights"] for x in read_jsonl(out) if x.get("summary")} == {"int8"}
    assert "float weights" not in r.stdout and "generate: weights per variant" in r.stdout


@pytest.mark.parametrize("engine", ["int8", "bf16"])
def test_first_token_rows_name_the_prefill_engine(tmp_path, monkeypatch, engine):
    """On a GGUF's block layers a first-token row says which engine read the prompt's chunks
    (``$SELFEXTEND_PREFILL``), so the two rates can be told apart in one results file."""
    from test_models import write_tiny_gguf

    from selfextend.native.quant import quant_kernels

    if quant_kernels() is None:
        pytest.skip("no C compiler here to build the kernel")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=64, quant="Q8_0")
    monkeypatch.setenv("SELFEXTEND_PREFILL", engine)
    monkeypatch.setenv("SELFEXTEND_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.jsonl"
    args = ["bench", "--model", str(path), "--weights", "gguf", "--forms", "gguf", "--cases", "first-token"]
    r = CliRunner().invoke(
        main, [*args, "--lengths", "130", "--repeats", "1", "-g", "2", "-w", "32", "-o", str(out)]
    )
    assert r.exit_code == 0, r.stderr
    ours = [x for x in read_jsonl(out) if x["variant"] != "llama.cpp"]  # a run and its summary
    assert [(x["variant"], x["prefill_engine"], x.get("summary", False)) for x in ours] == [
        ("gguf+selfextend", engine, False),
        ("gguf+selfextend", engine, True),
    ]


def test_generate_ratios_to_llama_cpp_per_round():
    """Rounds are interleaved, so each has its own ratio beside the ratio of the medians."""
    from selfextend.bench.runner import summarize

    rates = {"int8": (30.0, 40.0, 20.0), "llama.cpp": (20.0, 40.0, 10.0)}
    runs = [
        {"case": "generate", "variant": v, "length": 512, "repeat": i, "tokens_per_s": x}
        for v, xs in rates.items()
        for i, x in enumerate(xs)
    ]
    (row,) = [r for r in summarize(runs) if r["variant"] == "int8"]
    assert row["ratio"] == 30.0 / 20.0
    assert row["round_ratios"] == [1.5, 1.0, 2.0]


def test_the_read_bandwidth_probe() -> None:
    """The STREAM-style probe reads its buffer at a plausible rate (0.5-2000 GB/s: some memory, no cache
    fiction), and refuses a read of nothing."""
    from selfextend.native.stream import stream_probe

    probe = stream_probe()
    if probe is None:
        pytest.skip("no C compiler here to build the probe")
    assert 0.5 < probe(64, 2) < 2000
    with pytest.raises(ValueError, match="at least 1 MiB"):
        probe(0, 1)


def test_cpu_model_names_the_cpu(tmp_path, monkeypatch):
    """lscpu's "Model name" (from /proc/cpuinfo) is printed beside speeds; never empty, never raising."""
    from pathlib import Path

    from selfextend.bench import speed

    assert speed.cpu_model()
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: avx2\n")
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda p, *a, **k: real(info if str(p) == "/proc/cpuinfo" else p))
    assert speed.cpu_model() == "AMD EPYC 9B14"


def test_wait_for_quiet_waits_for_a_quiet_second(monkeypatch):
    """It returns at the first second the machine is quiet enough, or at the timeout with what it saw."""
    import psutil

    from selfextend.bench import speed

    seen = iter([90.0, 70.0, 10.0, 5.0])
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval: next(seen))
    assert speed.wait_for_quiet(0.2, 60) == 0.1
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval: 80.0)
    assert speed.wait_for_quiet(0.2, 0) == 0.8


def test_others_cpu_leaves_out_this_process_and_its_children():
    """The share is of other processes' time: a child's busy second is not counted as another tenant's."""
    import subprocess
    import sys

    from selfextend.bench import speed

    record: dict = {}
    with speed.others_cpu(record):
        subprocess.run([sys.executable, "-c", "sum(range(2 * 10**7))"], check=True)
    assert 0.0 <= record["others_cpu"] <= 1.0


def test_bench_speculative_case(tmp_path):
    """``--cases speculative`` on a tiny GGUF: plain and lookup rows per round, the lookup's tokens plain's,
    its acceptance and tokens per pass recorded and said."""
    import json

    from test_models import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "t.gguf", hidden=256, heads=4, kv_heads=2, quant="Q8_0")
    out = tmp_path / "spec.jsonl"
    args = [
        "bench",
        "-m",
        gguf,
        "--weights",
        "gguf",
        "--cases",
        "speculative",
        "--endless-tokens",
        "40",
        "-w",
        "64",
    ]
    r = CliRunner().invoke(main, [str(a) for a in [*args, "--repeats", "2", "--lookup", "4", "-o", out]])
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [x for x in rows if not x.get("summary")]
    assert sorted((x["variant"], x["repeat"]) for x in runs) == [
        ("lookup 4", 0),
        ("lookup 4", 1),
        ("plain", 0),
        ("plain", 1),
    ]
    assert all(x["identical"] for x in runs)
    drafted = [x for x in runs if x["variant"] == "lookup 4"]
    assert all(x["drafted"] > 0 and x["tokens_per_pass"] >= 1 for x in drafted)
    assert "speculative lookup 4:" in r.stdout and "identical to plain's in every round" in r.stdout


def test_bench_plot_keeps_runs_of_other_settings_apart(tmp_path, monkeypatch):
    """Two bench runs appended to one file with other G and W: two Self-Extend lines (they were one, the
    medians of both, records naming no G or W); its decode records not drawn, said."""
    from matplotlib.figure import Figure

    from selfextend.evaluation.plot import plot_bench
    from selfextend.evaluation.results import ResultsWarning

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    runs = [
        {
            "case": "prefill",
            "variant": v,
            "length": n,
            "seconds": n / g,
            "peak_mib": 1.0,
            "group_size": g,
            "window": w,
        }
        for g, w in ((4, 256), (2, 512))
        for v in ("plain", "selfextend")
        for n in (512, 1024)
    ]
    runs.append({"case": "decode", "variant": "plain", "length": 96, "ms_per_token": 9.0})
    with pytest.warns(ResultsWarning, match="decode records not drawn"):
        plot_bench(runs, tmp_path / "b.png")
    labels = sorted(line.get_label() for line in saved[0].axes[0].get_lines())
    assert labels == ["plain", "selfextend G=2 W=512", "selfextend G=4 W=256"]
