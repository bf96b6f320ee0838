"""Aggregating results across documents: the numbers `table` prints are the ones `plot` draws."""

from __future__ import annotations

import json
import statistics
import warnings

import matplotlib
import pytest
from click.testing import CliRunner

from selfextend.cli.main import main
from selfextend.evaluation.aggregate import AggregateError, format_table, summarize
from selfextend.evaluation.results import ResultsWarning

matplotlib.use("Agg")

PPL = {  # (doc, method, length) -> ppl_last
    ("a", "plain", 1024): 10.0,
    ("a", "plain", 2048): 12.0,
    ("a", "plain", 4096): 60.0,
    ("b", "plain", 1024): 20.0,
    ("b", "plain", 2048): 16.0,
    ("b", "plain", 4096): 200.0,
    ("c", "plain", 1024): 30.0,
    ("c", "plain", 2048): 32.0,
    ("c", "plain", 4096): 64.0,
    ("a", "selfextend:G=4,W=512", 1024): 10.0,
    ("a", "selfextend:G=4,W=512", 2048): 12.0,
    ("a", "selfextend:G=4,W=512", 4096): 13.2,
    ("b", "selfextend:G=4,W=512", 1024): 20.0,
    ("b", "selfextend:G=4,W=512", 2048): 16.0,
    ("b", "selfextend:G=4,W=512", 4096): 16.0,
    ("c", "selfextend:G=4,W=512", 1024): 30.0,
    ("c", "selfextend:G=4,W=512", 2048): 32.0,
    ("c", "selfextend:G=4,W=512", 4096): 35.2,
}


def _records() -> list[dict]:
    return [
        {"model": "m", "doc": d, "method": m, "length": n, "ppl_last": v, "ppl": v / 2, "seconds": 1.0}
        for (d, m, n), v in PPL.items()
    ]


def test_mean_median_and_range_over_documents():
    s = summarize(_records())
    assert s.methods == ["plain", "selfextend:G=4,W=512"]  # in the order the sweep ran them
    cell = s.cells[("plain", 4096)]
    assert cell.value == pytest.approx((60 + 200 + 64) / 3) and (cell.low, cell.high, cell.n) == (60, 200, 3)
    assert summarize(_records(), stat="median").cells[("plain", 4096)].value == 64
    assert summarize(_records(), stat="gmean").cells[("plain", 1024)].value == pytest.approx(
        statistics.geometric_mean([10, 20, 30])
    )
    assert summarize(_records(), field="ppl").cells[("plain", 1024)].value == pytest.approx(10)


def test_ratio_is_per_document_then_aggregated():
    s = summarize(_records(), ratio=True, trained_window=3000)
    assert s.reference == 2048  # the longest length within the trained window
    plain = s.cells[("plain", 4096)]
    assert plain.value == pytest.approx((60 / 12 + 200 / 16 + 64 / 32) / 3)
    assert s.cells[("selfextend:G=4,W=512", 4096)].value == pytest.approx((1.1 + 1.0 + 1.1) / 3)
    assert s.cells[("plain", 2048)].value == 1.0
    assert summarize(_records(), ratio=True, reference=1024).cells[("plain", 2048)].value == pytest.approx(
        (1.2 + 0.8 + 32 / 30) / 3
    )
    with pytest.raises(AggregateError, match="reference length 3000 was not measured"):
        summarize(_records(), ratio=True, reference=3000)
    with pytest.raises(AggregateError, match="unknown statistic"):
        summarize(_records(), stat="mode")


def test_table_formats():
    s = summarize(_records())
    md = format_table(s).splitlines()
    assert md[0] == "mean perplexity, last quarter of the context (ppl_last), over 3 documents: a, b, c"
    assert md[2] == "| method | 1k | 2k | 4k |"
    assert md[4] == "| plain | 20.00 (10.00-30.00) | 20.00 (12.00-32.00) | 108.00 (60.00-200.00) |"
    assert md[5].endswith("| 21.47 (13.20-35.20) |")
    csv = format_table(s, "csv").splitlines()
    assert csv[0] == "method,length,value,low,high,documents" and csv[3] == "plain,4096,108,60,200,3"
    tex = format_table(s, "latex")
    assert (
        r"\begin{tabular}{lrrr}" in tex
        and r"plain & 20.00 (10.00-30.00)" in tex
        and tex.endswith(r"\end{tabular}")
    )
    with pytest.raises(AggregateError, match="unknown table format"):
        format_table(s, "html")


def test_passkey_accuracy_over_depths():
    recs = [
        {
            "model": "m",
            "method": "plain",
            "length": 4096,
            "depth": d,
            "trial": t,
            "correct": d < 0.5 or t == 0,
        }
        for d in (0.0, 0.5, 1.0)
        for t in (0, 1)
    ]
    s = summarize(recs)
    assert s.kind == "passkey" and s.cells[("plain", 4096)].hits == 4 and s.cells[("plain", 4096)].n == 6
    assert format_table(s).splitlines()[4] == "| plain | 4/6 |"


@pytest.mark.parametrize("kwargs", [{}, {"ratio": True}, {"per_doc": True}])
def test_plot_draws_the_table_numbers_with_plain_tick_labels(tmp_path, monkeypatch, kwargs):
    from matplotlib.figure import Figure

    from selfextend.evaluation.plot import plot_ppl

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot_ppl(_records(), tmp_path / "p.png", trained_window=2048, **kwargs)
    (fig,) = saved
    axes = [ax for ax in fig.axes if ax.get_lines()]
    drawn = {
        (line.get_label(), x): y
        for ax in axes[:1]
        for line in ax.get_lines()
        for x, y in zip(*line.get_data(), strict=True)
    }
    docs = ["a"] if kwargs.get("per_doc") else None
    records = [r for r in _records() if docs is None or r["doc"] in docs]
    s = summarize(records, ratio=kwargs.get("ratio", False), trained_window=2048)
    for (method, n), cell in s.cells.items():
        assert drawn[(method, n)] == pytest.approx(cell.value)
    fig.canvas.draw()
    labels = [t.get_text() for ax in axes for t in ax.get_yticklabels() if t.get_text()]
    assert labels and all("times" not in t and "^" not in t for t in labels)
    assert any("trained" in t.get_text() for t in axes[0].get_xticklabels())
    assert axes[-1].get_legend() is not None and axes[-1].get_legend().get_bbox_to_anchor().x0 > 0


def test_heatmap_counts_contrast_with_cells():
    import matplotlib.pyplot as plt

    from selfextend.evaluation.plot import _text_colour

    cmap = plt.get_cmap("RdYlGn")
    assert _text_colour(cmap(0.0)) == "white" and _text_colour(cmap(1.0)) == "white"
    assert _text_colour(cmap(0.5)) == "black"


def test_table_and_plot_commands(tmp_path):
    path = tmp_path / "ppl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    runner = CliRunner()
    r = runner.invoke(main, ["table", str(path), "--trained-window", "2048", "--ratio", "-f", "csv"])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == "method,length,value,low,high,documents"
    r = runner.invoke(
        main,
        ["plot", str(path), "--trained-window", "2048", "--stat", "median", "-o", str(tmp_path / "x.png")],
    )
    assert r.exit_code == 0 and (tmp_path / "x.png").stat().st_size > 10000
    r = runner.invoke(main, ["plot", str(path), "--trained-window", "2048", "-o", str(tmp_path / "noext")])
    assert r.exit_code == 0 and r.output.strip() == f"wrote {tmp_path / 'noext.png'}", r.output  # as written
    assert (tmp_path / "noext.png").stat().st_size > 10000 and not (tmp_path / "noext").exists()
    named_png = tmp_path / "results.png"  # results under a .png name: its default picture was itself
    named_png.write_bytes(path.read_bytes())
    for args in ([str(named_png)], [str(path), "-o", str(path)]):
        r = runner.invoke(main, ["plot", *args, "--trained-window", "2048"])
        assert r.exit_code == 2 and "would overwrite the results" in r.stderr, r.output
    assert named_png.read_bytes() == path.read_bytes()
    # pictures that cannot be written: refused before anything is drawn (they failed after it, in raw words)
    for out, says in (
        ("/proc/x.png", "cannot write /proc/x.png: No such file or directory"),
        (str(tmp_path / "x.txt"), ".txt is not a picture format (use one of"),
        (str(tmp_path), "is a directory"),
    ):
        r = runner.invoke(main, ["plot", str(path), "--trained-window", "2048", "-o", out])
        assert r.exit_code == 2 and says in r.stderr and "wrote" not in r.output, r.output
    r = runner.invoke(main, ["plot", str(path), "--trained-window", "2048", "-o", str(tmp_path / "d/x.pdf")])
    assert r.exit_code == 0 and (tmp_path / "d/x.pdf").read_bytes().startswith(b"%PDF"), r.output
    r = runner.invoke(main, ["table", str(path), "--ratio", "--reference", "999"])
    assert r.exit_code == 2 and "reference length 999 was not measured" in r.stderr
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"case": "prefill", "variant": "plain", "length": 1, "seconds": 1}) + "\n")
    r = runner.invoke(main, ["table", str(bench)])
    assert r.exit_code == 2 and "table takes ppl or passkey" in r.stderr


def _mixed() -> list[dict]:
    """A two-document sweep, then two methods added on one document only (and not at the reference)."""
    recs = [r for r in _records() if r["doc"] in ("a", "b")]
    for method in ("ntk:factor=2", "yarn:factor=2"):
        recs += [
            {"model": "m", "doc": "a", "method": method, "length": n, "ppl_last": 11.0, "ppl": 5.0}
            for n in (1024, 4096)
        ]
    return recs


def test_methods_are_compared_over_the_documents_they_share():
    with pytest.warns(ResultsWarning, match=r"ntk:factor=2, yarn:factor=2 measured fewer.*left out: b"):
        s = summarize(_mixed())
    assert s.documents == ["a"]
    assert s.cells[("plain", 4096)].value == 60 and s.cells[("selfextend:G=4,W=512", 4096)].value == 13.2
    assert all(c.n == 1 for c in s.cells.values())
    assert format_table(s).splitlines()[0].endswith("over 1 document: a")


def test_ratio_leaves_out_methods_without_the_reference_instead_of_empty_rows():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = summarize(_mixed(), ratio=True, reference=2048)
    assert any("no PPL at the reference length 2048 for ntk" in str(w.message) for w in caught)
    assert s.methods == ["plain", "selfextend:G=4,W=512"]
    rows = format_table(s).splitlines()[4:]
    assert len(rows) == 2 and all("|  |" not in row for row in rows)
    # the default reference: the longest length inside the window that every method measured (1k), not
    # the longest inside it (2k), which two of the four lack
    assert summarize(_mixed(), ratio=True, trained_window=2048).reference == 1024


def test_methods_without_a_shared_document_carry_their_counts():
    recs = [r for r in _records() if r["method"] == "plain" and r["doc"] != "a"]
    recs += [r for r in _records() if r["method"] != "plain" and r["doc"] == "a"]
    with pytest.warns(ResultsWarning, match="no document was measured with every method"):
        s = summarize(recs)
    assert s.cells[("plain", 1024)].n == 2 and s.cells[("selfextend:G=4,W=512", 1024)].n == 1
    md = format_table(s)
    assert "| plain (2 docs) |" in md and "| selfextend:G=4,W=512 (1 doc) |" in md


def test_a_point_missing_on_one_document_is_marked():
    recs = [r for r in _records() if not (r["method"] == "plain" and r["doc"] == "c" and r["length"] == 4096)]
    with pytest.warns(ResultsWarning, match="1 cell over fewer documents"):
        s = summarize(recs)
    assert "[2 of 3 docs]" in format_table(s).splitlines()[4]


@pytest.mark.parametrize("kwargs", [{}, {"ratio": True}, {"per_doc": True}])
def test_plot_of_mixed_documents_has_a_line_for_every_legend_entry(tmp_path, monkeypatch, kwargs):
    from matplotlib.figure import Figure

    from selfextend.evaluation.plot import plot_ppl

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    with warnings.catch_warnings(record=True):  # per document, nothing is mixed: no warning to expect
        plot_ppl(_mixed(), tmp_path / "p.png", trained_window=2048, **kwargs)
    (fig,) = saved
    drawn = {line.get_label() for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata())}
    legend = [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]
    assert legend and set(legend) <= drawn
    if not kwargs:
        assert fig.axes[0].get_title() == "1 document: a"


def test_table_keeps_models_and_dtypes_apart_and_counts_a_point_once(tmp_path):
    """One point measured for two models and two dtypes in one file: three rows, not one row showing
    whichever came last; a passkey file with every trial twice: each trial counted once."""
    path = tmp_path / "models.jsonl"
    base = {"doc": "a", "method": "plain", "length": 1024, "ppl": 5.0}
    runs = [("smollm2", "float32", 10.0), ("gemma3", "float32", 100.0), ("smollm2", "bfloat16", 50.0)]
    path.write_text(
        "".join(json.dumps({**base, "model": m, "dtype": d, "ppl_last": v}) + "\n" for m, d, v in runs)
    )
    r = CliRunner().invoke(main, ["table", str(path), "--trained-window", "2048", "-f", "csv"])
    assert r.exit_code == 0, r.output
    rows = {line.split(",")[0]: float(line.split(",")[2]) for line in r.output.splitlines()[1:]}
    assert rows == {f"{m} {d} plain": v for m, d, v in runs}
    trials = tmp_path / "pk.jsonl"
    pk = {"model": "m", "dtype": "float32", "seed": 0, "method": "plain", "length": 256, "depth": 0.5}
    once = [{**pk, "trial": t, "correct": t == 0} for t in range(2)]
    trials.write_text("".join(json.dumps(rec) + "\n" for rec in once + once))
    r = CliRunner().invoke(main, ["table", str(trials), "--trained-window", "2048"])
    assert r.exit_code == 0 and "1/2" in r.output and "2/4" not in r.output, r.output
    newer = [{**rec, "prompt": 2, "correct": True} for rec in once]  # the same trials asked in form 2
    trials.write_text("".join(json.dumps(rec) + "\n" for rec in once + newer))
    r = CliRunner().invoke(main, ["table", str(trials), "--trained-window", "2048"])
    assert r.exit_code == 0 and "2/2" in r.stdout and "3/4" not in r.stdout, r.output
    assert "2 trials of an older passkey prompt left out" in r.stderr, r.output


def test_two_texts_under_one_document_name_are_two_documents(tmp_path):
    """A probe's case: a sweep of another file named like the first (``--corpus alt``) into the same output
    is measured again (its text differs), but table put the new text's 512 beside the old text's 1k in one
    row, the old 512 gone. Each text is now its own document, said in a warning."""
    path = tmp_path / "two.jsonl"
    base = {"model": "m", "dtype": "float32", "doc": "sherlock-holmes", "method": "plain"}
    rows = [("aaaaaaaaaaaaaaaa", 512, 47.5), ("aaaaaaaaaaaaaaaa", 1024, 34.8), ("bbbbbbbbbbbbbbbb", 512, 7.4)]
    path.write_text(
        "".join(
            json.dumps({**base, "text": t, "length": n, "ppl": v, "ppl_last": v}) + "\n" for t, n, v in rows
        )
    )
    r = CliRunner().invoke(main, ["table", str(path), "--trained-window", "2048", "-f", "csv"])
    assert r.exit_code == 0, r.output
    assert "sherlock-holmes: records of 2 texts under one name" in r.stderr
    cells = {
        int(n): (float(v), int(docs))
        for _, n, v, _, _, docs in map(lambda x: x.split(","), r.stdout.splitlines()[1:])
    }
    assert cells == {512: (pytest.approx((47.5 + 7.4) / 2), 2), 1024: (34.8, 1)}  # the 1k: one text's only
    r = CliRunner().invoke(main, ["table", str(path), "--trained-window", "2048"])
    assert "over 2 documents: sherlock-holmes [aaaaaaaa], sherlock-holmes [bbbbbbbb]" in r.stdout, r.output


def test_a_byte_order_mark_costs_no_record(tmp_path):
    path = tmp_path / "bom.jsonl"
    records = [r for r in _records() if r["length"] == 1024 and r["method"] == "plain"]
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in records).encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResultsWarning)  # no line skipped
        r = CliRunner().invoke(main, ["table", str(path), "--trained-window", "2048", "-f", "csv"])
    assert r.exit_code == 0 and ",3\n" in r.output.replace("\r", ""), r.output  # all three documents


def test_options_a_file_does_not_read_are_refused_and_latex_escapes(tmp_path):
    """Options that were ignored without a word: --ratio, --per-doc, --stat, --field on passkey or bench
    results, --reference without --ratio (it only changed the decimals); a record of length -2048 or
    depth 7 (hand-edited) was counted; an ``&`` in a model's name split a LaTeX row."""
    runner = CliRunner()
    keys = tmp_path / "pk.jsonl"
    rows = [
        {"model": "m", "method": "plain", "length": 1024, "depth": d, "trial": 0, "correct": True}
        for d in (0.0, 1.0, 7.0)
    ]
    keys.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for args in (
        ["table", "--ratio"],
        ["table", "--stat", "median"],
        ["plot", "--per-doc"],
        ["plot", "--ratio"],
    ):
        r = runner.invoke(main, [args[0], str(keys), *args[1:], "--trained-window", "2048"])
        assert r.exit_code == 2 and "applies to perplexity results" in r.stderr and "passkey" in r.stderr, (
            r.output
        )
    r = runner.invoke(main, ["table", str(keys), "--trained-window", "2048"])
    assert r.exit_code == 0 and "| plain | 2/2 |" in r.output, r.output  # depth 7 skipped, said
    path = tmp_path / "ppl.jsonl"
    edited = [*_records(), {"model": "m", "doc": "a", "method": "plain", "length": -2048, "ppl_last": 9.0}]
    path.write_text("".join(json.dumps({**r, "method": r["method"] + "&co_x"}) + "\n" for r in edited))
    r = runner.invoke(main, ["table", str(path), "--reference", "1024"])
    assert r.exit_code == 2 and "give --ratio too" in r.stderr, r.output
    r = runner.invoke(main, ["table", str(path), "-f", "latex", "--trained-window", "2048"])
    assert r.exit_code == 0 and "-2048" not in r.output, r.output
    header = next(line for line in r.output.splitlines() if line.startswith("method &"))
    row = next(line for line in r.output.splitlines() if line.startswith(r"plain\&co\_x &"))
    assert row.count(" & ") == header.count(" & ")


@pytest.mark.parametrize("weights", ["", "+int8"])
def test_ratio_finds_the_trained_window_of_a_weights_run(tmp_path, weights):
    """Records of ``ppl --weights int8`` name ``smollm2-135m+int8``: the window was looked up under that
    name, not found, and --ratio divided by the longest length (16k, past the 8k window) without a word."""
    path = tmp_path / "r.jsonl"
    base = {"model": f"smollm2-135m{weights}", "dtype": "float32", "doc": "a", "method": "plain", "ppl": 1.0}
    path.write_text(
        "".join(json.dumps({**base, "length": n, "ppl_last": n / 1024}) + "\n" for n in (4096, 8192, 16384))
    )
    r = CliRunner().invoke(main, ["table", str(path), "--ratio"])
    assert r.exit_code == 0 and "relative to 8192 tokens" in r.output and "warning" not in r.stderr, r.output
    path.write_text(path.read_text().replace("smollm2-135m", "no-such-model-here"))
    r = CliRunner().invoke(main, ["table", str(path), "--ratio"])
    assert r.exit_code == 0 and "relative to 16384 tokens" in r.output and "--trained-window" in r.stderr


def test_records_of_two_models_name_both_and_mark_no_single_window(tmp_path, monkeypatch):
    """A file with SmolLM2 (8k window) and Gemma 3 (32k) points: the plot's title named only the first
    record's model and marked its window for both; --ratio divided by the longest length in the first
    one's window (4k, which only SmolLM2 measured), leaving Gemma out. Now both are named, no window is
    marked (said), and the ratio divides by the longest length both measured."""
    from matplotlib.figure import Figure

    path = tmp_path / "two.jsonl"
    base = {"dtype": "float32", "doc": "a", "method": "plain", "ppl": 1.0}
    points = [("smollm2-135m", n) for n in (1024, 2048, 4096)] + [("gemma3-270m", n) for n in (1024, 2048)]
    path.write_text(
        "".join(json.dumps({**base, "model": m, "length": n, "ppl_last": n / 512}) + "\n" for m, n in points)
    )
    r = CliRunner().invoke(main, ["table", str(path), "--ratio"])
    assert r.exit_code == 0 and "relative to 2048 tokens" in r.output, r.output
    assert "smollm2-135m 8,192, gemma3-270m 32,768" in r.stderr and "left out" not in r.stderr, r.stderr
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    r = CliRunner().invoke(main, ["plot", str(path), "-o", str(tmp_path / "two.png")])
    assert r.exit_code == 0, r.output
    (fig,) = saved
    assert fig._suptitle.get_text().endswith("— smollm2-135m, gemma3-270m")
    assert not any("trained" in t.get_text() for t in fig.axes[0].get_xticklabels())
