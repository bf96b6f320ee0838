"""``selfextend bench --cases server``: its options and its run (ours against llama-server under load)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import click

from selfextend.bench.trimmed_chat import TOPICS
from selfextend.cli.options import (
    POSITIVE,
    QUIETED,
    cache_reuse_option,
    integer,
    parallel_option,
    without_our_waits,
)
from selfextend.core.validate import plural

LABELS = {  # ratio key -> column title
    "aggregate_tokens_per_second": "tok/s",
    "ttft_p50_s": "TTFT p50",
    "ttft_p95_s": "TTFT p95",
    "ttft_median_s": "chat TTFT",
}


def server_options(f: Callable) -> Callable:
    """The server case's options (the other cases ignore them)."""
    f = click.option(
        "--turns",
        type=integer(0, hi=len(TOPICS)),
        default=len(TOPICS),
        show_default=True,
        help="Server case: turns of the scripted chat trimmed from the front, after the load (0: none).",
    )(f)
    f = click.option(
        "--reply-tokens",
        type=POSITIVE,
        default=64,
        show_default=True,
        help="Server case: tokens of every load reply (both servers write exactly this many).",
    )(f)
    f = click.option(
        "--requests", type=POSITIVE, default=6, show_default=True, help="Server case: requests per client."
    )(f)
    f = click.option(
        "--clients",
        type=POSITIVE,
        default=8,
        show_default=True,
        help="Server case: concurrent streaming clients.",
    )(f)
    f = cache_reuse_option(f)
    f = parallel_option(4)(f)
    return click.option(
        "--llama-server",
        "llama_server",
        type=click.Path(dir_okay=False),
        default=None,
        help="Server case: llama.cpp's llama-server binary (default: the one on $PATH).",
    )(f)


def run_server_case(
    model: str,
    llama_server: str | None,
    weights: str | None,
    cache_type: str | None,
    repeats: int,
    out: str | None,
    **load: int,
) -> None:
    """Ours against llama-server, ``repeats`` interleaved rounds; a table per round and the medians.
    ``load``: parallel, ctx, cache_reuse, clients, requests, reply_tokens, turns. ``weights``: ours' (None:
    serve's default)."""
    from selfextend.bench.servers import (
        ServerSetup,
        YardstickError,
        find_llama_server,
        gguf_tokenizer,
        rounds,
    )

    try:  # before torch's seconds of importing
        binary = find_llama_server(llama_server)
    except YardstickError as e:
        raise click.BadParameter(str(e), param_hint="--llama-server") from None
    import torch

    from selfextend.evaluation.results import append_jsonl
    from selfextend.models import resolve_model

    gguf = resolve_model(model).gguf_path
    if gguf is None:
        raise click.BadParameter(
            "the server case needs a GGUF model (llama-server reads GGUF only)", param_hint="--model"
        )
    setup = ServerSetup(
        gguf,
        binary,
        parallel=load["parallel"],
        ctx=load["ctx"],
        threads=torch.get_num_threads(),
        cache_type=cache_type or "f16",
        cache_reuse=load["cache_reuse"],
        weights=weights or "auto",
        clients=load["clients"],
        requests=load["requests"],
        max_tokens=load["reply_tokens"],
        turns=load["turns"],
        llama_env=without_our_waits(os.environ),
    )
    s = setup
    click.echo(
        f"server: {gguf.name}, selfextend serve --weights {s.weights} against {binary}; "
        f"{plural(s.parallel, 'slot')} of {s.ctx} {s.cache_type} cells, {plural(s.threads, 'thread')}, "
        f"cache reuse {s.cache_reuse}; {plural(s.clients, 'client')} x {plural(s.requests, 'request')} of "
        f"{s.max_tokens} tokens, then {s.turns} trimmed-chat turns; {plural(repeats, 'round')}, interleaved"
    )
    if QUIETED:
        waits = (
            f"{', '.join(f'{k}={os.environ[k]}' for k in QUIETED)} for ours, llama-server's default for it"
        )
    else:
        waits = "as your environment sets them, for both"
    click.echo(f"OpenMP waits: {waits}; the servers' output in {s.logs}")
    header = f"{'round':>5} {'server':<13} {'tok/s':>8} " + " ".join(
        f"{t:>9}" for t in list(LABELS.values())[1:]
    )
    header += f" {'RSS MiB':>8}"
    lines, per_round = [header], []
    for round_, records, ratio in rounds(setup, gguf_tokenizer(gguf), repeats):
        for r in records:
            r["variant"] = r["server"]
            if out:
                append_jsonl(out, r)
        for name in ("selfextend", "llama-server"):
            load_row = next(r for r in records if r["server"] == name and r["phase"] == "load")
            chat = next((r for r in records if r["server"] == name and r["phase"] == "trimmed_chat"), {})
            if load_row["ok"] < load_row["requests"]:
                click.echo(
                    f"warning: {name}: {load_row['requests'] - load_row['ok']} requests failed", err=True
                )
            lines.append(
                f"{round_:>5} {name:<13} {load_row['aggregate_tokens_per_second']:>8.1f} "
                f"{_s(load_row['ttft_p50_s']):>9} {_s(load_row['ttft_p95_s']):>9} "
                f"{_s(chat.get('ttft_median_s')):>9} {load_row['rss_end_mib']:>8.0f}"
            )
        lines.append(f"{round_:>5} {'ours/theirs':<13} " + " ".join(_x(ratio, k) for k in LABELS))
        click.echo(lines[-1], err=True)
        per_round.append(ratio)
    medians = {
        k: round(statistics.median(r[k] for r in per_round), 3)
        for k in LABELS
        if all(k in r for r in per_round)
    }
    if out:
        append_jsonl(
            out,
            {
                "summary": True,
                "case": "server",
                "model": gguf.name,
                "ratios_per_round": per_round,
                "median_ratios": medians,
            },
        )
    click.echo("\n" + "\n".join(lines))
    click.echo(f"{'median':>5} {'ours/theirs':<13} " + " ".join(_x(medians, k) for k in LABELS))
    click.echo(
        "ours/theirs: selfextend serve over llama-server in the same round (tok/s: above 1 is ours ahead; "
        "times: below 1 is ours ahead); chat TTFT: the trimmed chat's median from its first trimmed turn on"
    )


def _s(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.2f} s"


def _x(ratio: dict, key: str) -> str:
    width = 8 if key == "aggregate_tokens_per_second" else 9
    return f"{ratio[key]:.2f}x".rjust(width) if key in ratio else " " * width
