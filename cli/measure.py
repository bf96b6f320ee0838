"""``selfextend ppl`` and ``passkey``: measurements written as JSON Lines, resumable point by point."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from selfextend.cli.interrupts import prompt_interrupts
from selfextend.cli.options import (
    POSITIVE,
    SEED,
    device_map_option,
    dtype_default,
    interrupt_status,
    model_options,
    results_file,
    run_name,
    weights_option,
)
from selfextend.core.validate import plural


def _methods(specs: tuple[str, ...]):
    from selfextend.evaluation.methods import parse_methods

    return parse_methods(specs)


def _progress_bar(total: int, desc: str, procs=None):
    """A token progress bar on a terminal (a log gets no redrawn frames: each record's line says the
    progress there); launched on several processes, only the main one draws it."""
    from tqdm import tqdm

    if procs is not None and procs.world > 1:
        desc = f"{desc} rank {procs.rank}/{procs.world}"
        if procs.main and not sys.stderr.isatty():  # a log still says the sweep is shared, and how
            click.echo(f"{desc}: {total:,} of the sweep's tokens on this process", err=True)
    return tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        desc=desc,
        dynamic_ncols=True,
        disable=(procs is not None and not procs.main) or not sys.stderr.isatty(),
    )


def _join(out: str, key, dtype: str, model: str):
    """Join the sweep's processes (one, or those a launcher started), merging leftover rank files first.

    Returns the processes, the device this one uses (``--device`` if given, else its own) and the dtype it
    runs in (``--dtype`` if given, ``auto`` read as the model's own, else the default for that device: a
    launched process's own GPU too): what its records will say, so that the finished ones are skipped.
    """
    from selfextend.evaluation.distributed import merge, processes

    procs = processes()
    ctx = click.get_current_context()
    if procs.world > 1 and ctx.meta.get("device_map"):
        raise click.UsageError("--device-map places one model over several devices: run one process")
    if procs.main:
        added = merge(out, key)
        if added:
            click.echo(f"merged {added} records left by an earlier run into {out}", err=True)
    procs.wait()
    defaulted = {
        n for n in ("device", "dtype") if ctx.get_parameter_source(n) == click.core.ParameterSource.DEFAULT
    }
    device = procs.device(None if "device" in defaulted else ctx.params["device"])
    if "dtype" in defaulted:
        dtype = dtype_default(device, ctx.meta.get("device_map"))
    elif dtype == "auto":
        from selfextend.models.load import checkpoint_dtype

        dtype = str(checkpoint_dtype(model)).removeprefix("torch.")
    return procs, device, dtype


def _finish(procs, out: str, key) -> None:
    """Wait for every process, then merge their rank files into ``out``."""
    from selfextend.evaluation.distributed import merge

    procs.wait()
    if procs.main and procs.world > 1:
        merge(out, key)


def _resuming(out: str, todo: int, total: int, what: str) -> None:
    """Say how much of a sweep is already in ``out`` and skipped (nothing when starting afresh)."""
    if todo < total:
        click.echo(f"resuming: {total - todo} of {plural(total, what)} already in {out}, skipped", err=True)


def _fits(model, runs, cells: bool) -> None:
    """Refuse lengths past the memory there is before the first forward, warn of those that may not fit
    (:mod:`selfextend.evaluation.memory`)."""
    from selfextend.evaluation.memory import check_memory

    warning = check_memory(model, runs, cells)
    if warning:
        click.echo(f"warning: {warning}", err=True)


@contextmanager
def _resumable(out: str, what: str, mine: Path) -> Iterator[list[int]]:
    """Around a sweep: Ctrl-C ends it with one line saying what is kept (in ``mine``, this process's
    output: ``out`` or, launched, its rank file, merged into ``out`` by the next run) and how to go on.

    Yields a one-element counter the caller increments per record written.
    """
    written = [0]
    where = str(out) if str(mine) == str(out) else f"{mine} (merged into {out} by the next run)"

    def kept() -> str:
        return (
            f"interrupted: {where} keeps every {what} finished ({written[0]} new in this run; the one in "
            "progress is lost). Run the same command again to resume: finished ones are skipped."
        )

    try:
        with (
            _only_writer(mine),
            prompt_interrupts(lambda: f"{kept()} (Stopped inside a long forward pass, not waiting for it.)"),
        ):
            yield written
    except KeyboardInterrupt as e:
        click.echo(f"\n{kept()}", err=True)
        sys.exit(interrupt_status(e))


@contextmanager
def _only_writer(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the results file ``path`` while this sweep appends to it: a second sweep
    given the same ``-o`` planned the same points and wrote each one twice; now it stops in one line.
    (An advisory ``flock``, released when the process ends however it ends; none where fcntl is not.)"""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    made = not path.exists()
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise click.ClickException(
                f"{path} is being written by another sweep: wait for it to end (its points are then "
                "skipped), or give another -o"
            ) from None
        try:
            yield
        finally:
            if made and path.exists() and not path.stat().st_size:  # no record came: no empty file left
                path.unlink()


METHOD_HELP = (
    "Repeatable: plain, selfextend:G=4,W=1024, ntk:factor=4, yarn:factor=4, "
    "shift:ctx=2048,keep=4 (shift may add G=..,W=..). Default: plain."
)


@click.command()
@model_options
@device_map_option
@weights_option("float")
@click.option(
    "--corpus",
    default="default",
    show_default=True,
    help="'default' (four Gutenberg books), a UTF-8 text file, or a folder of .txt files.",
)
@click.option(
    "--docs",
    help="Comma-separated document names to use (default: all). "
    "Default corpus: sherlock-holmes, us-history, surgery, war-and-peace.",
)
@click.option(
    "--dataset", help="A `datasets` dataset instead of --corpus: a hub name (pg19) or json/parquet/text."
)
@click.option("--dataset-config", help="The dataset's configuration name.")
@click.option("--split", default=None, help="The dataset split (default: test; train for --data-files).")
@click.option("--text-column", default="text", show_default=True, help="The dataset column holding the text.")
@click.option("--data-files", help="Local files for json/parquet/text datasets.")
@click.option("--max-docs", type=POSITIVE, default=None, help="Use at most this many documents.")
@click.option(
    "--lengths",
    default="1k,2k,4k,8k,16k",
    show_default=True,
    help="Context lengths in tokens (k = 1024); each document's first LENGTH tokens are scored.",
)
@click.option("--method", "methods", multiple=True, help=METHOD_HELP)
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False),
    callback=results_file,
    required=True,
    help="JSON Lines file; records are appended as points finish, finished points are skipped.",
)
def ppl(
    model: str,
    dtype: str,
    device: str,
    weights: str,
    corpus: str,
    docs: str | None,
    dataset: str | None,
    dataset_config: str | None,
    split: str | None,
    text_column: str,
    data_files: str | None,
    max_docs: int | None,
    lengths: str,
    methods: tuple[str, ...],
    out: str,
) -> None:
    """Perplexity against length for each document and method.

    Records: model, dtype, doc, method, length, ppl (all tokens), ppl_last (the last quarter, where
    extension methods differ), last_from, tokens, seconds, forward_length (the forward it came from: one
    forward scores every shorter length it covers).
    """
    from selfextend.evaluation.corpus import load_corpus, select
    from selfextend.evaluation.lengths import parse_lengths

    parsed_lengths, parsed_methods = parse_lengths(lengths, "--lengths"), _methods(methods)  # before torch
    from selfextend.evaluation.sweep import dtype_name, plan, ppl_sweep, tokenize_docs

    if not corpus.strip():  # ('' read as the current folder's text files)
        raise click.BadParameter(
            "names no file or folder (leave it out for the default)", param_hint="--corpus"
        )
    if dataset is not None and not dataset.strip():  # ('' read as no dataset: the default corpus)
        raise click.BadParameter("names no dataset (leave it out for --corpus)", param_hint="--dataset")
    source = click.get_current_context().get_parameter_source("corpus")
    if dataset is not None and source == click.core.ParameterSource.COMMANDLINE:  # --corpus was dropped
        raise click.UsageError("give the texts once: --corpus or --dataset, not both")
    texts = load_corpus(
        corpus,
        name=dataset,
        config=dataset_config,
        split=split,
        text_column=text_column,
        data_files=data_files,
        max_docs=max_docs,
    )
    names = None if docs is None else [n.strip() for n in docs.split(",") if n.strip()]
    if names == []:  # ('' read as all the documents)
        raise click.BadParameter("names no document (leave it out for all)", param_hint="--docs")
    texts = select(texts, names)
    if max_docs:
        texts = dict(list(texts.items())[:max_docs])
    from selfextend.cli.options import load_with_self_extend
    from selfextend.evaluation.sweep import point_key, run_cost

    procs, device, dtype = _join(out, point_key, dtype, model)
    name = run_name(model, weights, device)
    runs = plan(name, texts, parsed_methods, parsed_lengths, out, dtype_name(dtype))
    procs.agree(
        (
            name,
            str(dtype),
            str(Path(out).absolute()),
            [(r.doc, r.text, r.method.name, r.covers) for r in runs],
        )
    )
    if not runs:
        click.echo(f"all points already in {out}", err=True)
        return
    total = len(texts) * len(parsed_methods) * len(parsed_lengths)
    if procs.main:
        _resuming(out, sum(len(r.covers) for r in runs), total, "point")
    with procs.main_first():
        lm, tokenizer = load_with_self_extend(model, dtype, device, None, None, weights)
    _fits(lm, [(r.length, r.method) for r in runs], cells=False)
    ids = tokenize_docs(tokenizer, texts, runs)
    mine = procs.share(runs, lambda r: run_cost(r, lm.config.get_text_config().hidden_size))
    bar = _progress_bar(sum(r.length for r in mine), "ppl", procs)
    with _resumable(out, "point", procs.output(out)) as written, bar:
        for r in ppl_sweep(lm, name, ids, mine, procs.output(out), progress=bar.update):
            written[0] += 1
            bar.write(
                f"{r['doc']:>16} {r['method']:>24} {r['length']:>7}  ppl {r['ppl']:9.2f}"
                f"  last quarter {r['ppl_last']:9.2f}"
            )
    _finish(procs, out, point_key)
    if procs.main:
        click.echo(f"wrote {out}", err=True)


@click.command()
@model_options
@device_map_option
@weights_option("float")
@click.option("--lengths", default="2k,4k,8k", show_default=True, help="Prompt lengths in tokens (k = 1024).")
@click.option(
    "--depths",
    default="0,0.25,0.5,0.75,1",
    show_default=True,
    help="Where the passkey sits, as fractions of the filler (0 = start, 1 = end).",
)
@click.option(
    "--trials", type=POSITIVE, default=2, show_default=True, help="Random passkeys per (length, depth)."
)
@click.option("--method", "methods", multiple=True, help=METHOD_HELP)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the passkeys.")
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False),
    callback=results_file,
    required=True,
    help="JSON Lines file; one record per trial, appended as it finishes; finished trials are skipped.",
)
def passkey(
    model: str,
    dtype: str,
    device: str,
    weights: str,
    lengths: str,
    depths: str,
    trials: int,
    methods: tuple[str, ...],
    seed: int,
    out: str,
) -> None:
    """Passkey retrieval: a 5-digit key hidden in filler, asked for at the end, answered greedily."""
    from selfextend.cli.options import load_with_self_extend
    from selfextend.core.validate import ValidationError
    from selfextend.evaluation.lengths import parse_lengths

    parsed_lengths, parsed_methods = parse_lengths(lengths, "--lengths"), _methods(methods)  # before torch
    try:
        parsed_depths = sorted({float(d) for d in depths.split(",") if d.strip()})
    except ValueError:
        raise click.BadParameter(
            f"'{depths}': use fractions such as 0,0.5,1", param_hint="--depths"
        ) from None
    if not parsed_depths:
        raise click.BadParameter("names no depth: give fractions such as 0,0.5,1", param_hint="--depths")
    if not all(0 <= d <= 1 for d in parsed_depths):
        raise click.BadParameter("depths must lie in [0, 1]", param_hint="--depths")
    if trials < 1:
        raise click.BadParameter("at least 1", param_hint="--trials")
    from selfextend.evaluation.distributed import forward_cost
    from selfextend.evaluation.passkey import build_passkey_prompt, passkey_plan, passkey_sweep, point_key
    from selfextend.evaluation.results import read_jsonl
    from selfextend.evaluation.sweep import dtype_name

    procs, device, dtype = _join(out, point_key, dtype, model)
    name = run_name(model, weights, device)
    done = len(read_jsonl(out))
    points = passkey_plan(
        name, parsed_methods, parsed_lengths, parsed_depths, trials, out, dtype_name(dtype), seed
    )
    procs.agree((name, str(dtype), seed, str(Path(out).absolute()), [str(p) for p in points]))
    if procs.main and not points:
        click.echo(f"all trials already in {out}", err=True)
    if points and procs.main:
        total = len(parsed_methods) * len(parsed_lengths) * len(parsed_depths) * trials
        _resuming(out, len(points), total, "trial")
    if points:
        with procs.main_first():
            lm, tokenizer = load_with_self_extend(model, dtype, device, None, None, weights)
        _fits(lm, [(p.length, p.method) for p in points], cells=True)
        try:  # the shortest prompt the task fits in depends on the tokenizer: known now, before any trial
            build_passkey_prompt(tokenizer, min(p.length for p in points), 0.0, 99999)
        except ValidationError as e:
            raise click.BadParameter(e.requirement, param_hint="--lengths") from None
        hidden = lm.config.get_text_config().hidden_size
        mine = procs.share(points, lambda p: forward_cost(p.length, hidden))
        bar = _progress_bar(sum(p.length for p in mine), "passkey", procs)
        with _resumable(out, "trial", procs.output(out)) as written, bar:
            for r in passkey_sweep(lm, tokenizer, name, mine, procs.output(out), seed, progress=bar.update):
                written[0] += 1
                bar.write(
                    f"{r['method']:>24} {r['length']:>7} depth {r['depth']:.2f} #{r['trial']}: "
                    f"{'ok ' if r['correct'] else 'MISS'} {r['passkey']} -> {r['answer'][:20]!r}"
                )
        _finish(procs, out, point_key)
    if not procs.main:
        return
    records = read_jsonl(out)
    by_method: dict[str, list[bool]] = {}  # one figure per method (a pooled one hid which method missed)
    for r in records:
        by_method.setdefault(str(r.get("method")), []).append(r.get("correct") is True)
    accuracy = ", ".join(f"{m} {sum(c)}/{len(c)}" for m, c in by_method.items())
    click.echo(f"wrote {out}: {len(records) - done} new; accuracy over the file: {accuracy}", err=True)
