"""``selfextend plot`` and ``table``: JSONL results drawn as PNGs or printed as tables."""

from __future__ import annotations

from pathlib import Path

import click

from selfextend.cli.options import integer, model_of_run_name


def summary_options(f):
    """--field, --stat, --ratio, --reference: how ``plot`` and ``table`` aggregate over documents."""
    from selfextend.evaluation.aggregate import STATS

    f = click.option(
        "--reference",
        type=integer(2),
        default=None,
        help="With --ratio: the length (tokens) each method is divided by; default: the longest "
        "length within the trained window that every method measured.",
    )(f)
    f = click.option(
        "--ratio",
        is_flag=True,
        help="Each method's PPL over its own PPL at --reference (per document, then aggregated).",
    )(f)
    f = click.option(
        "--stat",
        type=click.Choice(list(STATS)),
        default="mean",
        show_default=True,
        help="How PPL is aggregated over documents (the spread shown is their min-max range).",
    )(f)
    f = click.option(
        "--field",
        type=click.Choice(["ppl_last", "ppl"]),
        default="ppl_last",
        show_default=True,
        help="For perplexity results: the last quarter of each context, or all of it.",
    )(f)
    f = click.option(
        "--trained-window",
        type=integer(2),
        default=None,
        help="The model's trained window in tokens (a plot marks it; the default reference of --ratio); "
        "default: the model's, when it can be read.",
    )(f)
    return f


PPL_ONLY = ("field", "stat", "ratio", "reference", "per_doc")
"""Options only perplexity results are read with (on passkey or bench results they were ignored)."""


def _check_options(kind: str, results: str) -> None:
    """Refuse options given that ``kind`` results do not read, and --reference without --ratio."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = [
        n for n in PPL_ONLY if n in ctx.params and ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE
    ]
    if kind != "ppl" and given:
        flag = "--" + given[0].replace("_", "-")
        raise click.UsageError(f"{flag} applies to perplexity results; {results} holds {kind} records")
    if "reference" in given and not ctx.params.get("ratio"):
        raise click.UsageError("--reference is the length --ratio divides by: give --ratio too")


def _records(results: str, trained_window: int | None, field: str = "ppl_last", command: str = "plot"):
    """The usable records of RESULTS (bad lines, other kinds, records missing fields: skipped, said)."""
    from selfextend.evaluation.results import read_jsonl
    from selfextend.evaluation.usable import records_kind, usable_records

    records = read_jsonl(results)
    if command == "table" and records_kind(records, results) not in ("ppl", "passkey"):
        kind = records_kind(records, results)
        raise click.UsageError(f"{results} holds {kind} records; table takes ppl or passkey results")
    kind, records = usable_records(records, field, results)
    _check_options(kind, results)
    if trained_window is None:
        models = list(dict.fromkeys(r.get("model") for r in records))
        windows = {m: _trained_window(m) for m in models}
        trained_window = windows[models[0]]
        if len(set(windows.values())) > 1:
            said = ", ".join(f"{m} {'unknown' if w is None else f'{w:,}'}" for m, w in windows.items())
            click.echo(
                f"warning: these records are of models with other trained windows ({said}): none is "
                "marked, and --ratio's default reference is the longest length every method measured; give "
                "--trained-window N",
                err=True,
            )
            trained_window = None
        elif trained_window is None and kind == "ppl":
            click.echo(
                f"warning: the trained window of {records[0].get('model')!r} is not known here (its model "
                "cannot be read): --ratio's default reference is then the longest length every method "
                "measured, and no window is marked; give --trained-window N",
                err=True,
            )
    return records, kind, trained_window


def _check_picture(target: Path) -> None:
    """Refuse, before anything is read or drawn, a picture that could not be written: a format matplotlib
    does not write, something other than a file, a file or name that cannot be written (tried: the folders
    made, an existing file opened to append, a new one made and removed; as root ``os.access`` passes
    everything, /proc too)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if target.suffix[1:].lower() not in formats:
        raise click.UsageError(
            f"cannot draw {target}: {target.suffix} is not a picture format (use one of "
            f"{', '.join('.' + f for f in sorted(formats))})"
        )
    if target.exists() and not target.is_file():
        raise click.UsageError(f"cannot draw {target}: it is not a regular file")
    above = next(p for p in target.absolute().parents if p.exists())
    if not above.is_dir():
        raise click.UsageError(f"cannot write {target}: {above} is not a folder")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            with target.open("ab"):
                pass
        else:
            with target.open("xb"):
                pass
            target.unlink()
    except OSError as e:
        raise click.UsageError(f"cannot write {target}: {e.strerror or e}") from None


@click.command()
@click.argument("results", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False),
    help="Picture to write, in the format its suffix names (.png, .pdf, .svg...; default: RESULTS with "
    ".png; .png added to a name without a suffix; missing folders are made).",
)
@summary_options
@click.option("--per-doc", is_flag=True, help="Perplexity: one panel per document instead of the aggregate.")
def plot(
    results: str,
    out: str | None,
    trained_window: int | None,
    field: str,
    stat: str,
    ratio: bool,
    reference: int | None,
    per_doc: bool,
) -> None:
    """Draw a JSONL results file as a PNG: PPL against length, passkey heatmaps, or bench time and memory.

    Perplexity is aggregated over documents (STAT, with the documents' range as a band), the same
    numbers `selfextend table` prints, over the documents every method has.
    """
    from selfextend.evaluation.plot import plot_bench, plot_passkey, plot_ppl

    target = Path(out) if out else Path(results).with_suffix(".png")
    if not target.suffix:  # matplotlib would add it: the name written is said as written
        target = target.with_name(target.name + ".png")
    if target.resolve() == Path(results).resolve():
        raise click.UsageError(f"the picture would overwrite the results {results}: name another with -o")
    _check_picture(target)
    records, kind, trained_window = _records(results, trained_window, field)
    if kind == "ppl":
        plot_ppl(records, target, trained_window, field, stat, per_doc, ratio, reference)
    elif kind == "passkey":
        plot_passkey(records, target, trained_window)
    else:
        plot_bench(records, target, trained_window)
    click.echo(f"wrote {target}")


@click.command()
@click.argument("results", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "-f",
    "--format",
    "fmt",
    type=click.Choice(["markdown", "csv", "latex"]),
    default="markdown",
    show_default=True,
    help="Table format.",
)
@summary_options
def table(
    results: str,
    fmt: str,
    trained_window: int | None,
    field: str,
    stat: str,
    ratio: bool,
    reference: int | None,
) -> None:
    """Print a ppl or passkey JSONL file as a table: methods by lengths, aggregated over documents.

    PPL cells read `value (min-max over documents)`; passkey cells hits/trials over all depths. A first
    line says which statistic of which field, over which documents. Methods measured on different
    documents are compared over the ones they all have (a warning names the rest).
    """
    from selfextend.evaluation.aggregate import format_table, summarize

    records, kind, trained_window = _records(results, trained_window, field, "table")
    click.echo(format_table(summarize(records, field, stat, ratio, reference, trained_window), fmt))


def _trained_window(model: str | None) -> int | None:
    from selfextend.models import ModelError, load_config, model_facts

    if not model:
        return None
    try:
        return model_facts(load_config(model_of_run_name(model))).trained_window
    except ModelError:
        return None
