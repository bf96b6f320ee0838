"""``selfextend bench``: prefill, decode and endless-generation cost, side by side in one process."""

from __future__ import annotations

from pathlib import Path

import click

from selfextend.cli.bench_server import run_server_case, server_options
from selfextend.cli.generation_options import Speculation, decode_options, speculative_options
from selfextend.cli.options import (
    COUNT,
    POSITIVE,
    checked_self_extend,
    integer,
    model_options,
    results_file,
    self_extend_options,
    weights_option,
)
from selfextend.core.validate import plural


@click.command()
@model_options
@weights_option("float")
@decode_options
@click.option(
    "--lengths", default="2k,4k,8k", show_default=True, help="Prefill lengths in tokens (k = 1024)."
)
@click.option(
    "--decode-lengths",
    default="4k",
    show_default=True,
    help="Cache lengths (tokens) at which decode milliseconds per token are measured.",
)
@self_extend_options(group_size=4, window=1024)
@click.option(
    "--repeats",
    type=POSITIVE,
    default=2,
    show_default=True,
    help="Rounds over all variants (medians reported).",
)
@click.option(
    "--reference-max",
    type=COUNT,
    default=8192,
    show_default=True,
    help="Longest prefill (tokens) for the full-matrix reference (quadratic memory).",
)
@click.option(
    "--ctx",
    type=integer(2),
    default=2048,
    show_default=True,
    help="Cache size (tokens) for endless generation; the server case: cells per slot, both servers.",
)
@click.option(
    "--endless-tokens",
    type=COUNT,
    default=1000,
    show_default=True,
    help="Tokens generated through the context-shift cache per repeat (0 = skip).",
)
@click.option(
    "--cases",
    default="prefill,decode,endless,generate",
    show_default=True,
    help="Which measurements to run: prefill, decode, endless (shift cache against plain decoding), "
    "generate (int8 and, for a GGUF, int4 and gguf weights, each plain and with Self-Extend, against "
    "llama.cpp when llama-cpp-python is installed), first-token (seconds to the first token of a --lengths "
    "prompt, int8, int4 and gguf with Self-Extend against llama.cpp; not default), server (selfextend serve "
    "against llama.cpp's llama-server under the same load, then a chat trimmed from the front; not default), "
    "speculative (greedy decoding of a paragraph to repeat: plain against --lookup N, 8 unless given, or "
    "--draft-model: tok/s, drafts kept, tokens per pass, identical tokens; not default).",
)
@click.option(
    "--forms",
    default="int8,int4,gguf",
    show_default=True,
    help="Weight forms the generate and first-token cases time (a GGUF; other models: int8 only), e.g. "
    "gguf,int4 where int8 is slow to load on a large model. On a GPU: the loaded --weights only (the int8, "
    "int4 and block products are the CPU's kernels).",
)
@server_options
@speculative_options
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False),
    callback=results_file,
    help="Also write every run and the summary as JSON Lines.",
)
def bench(
    model: str,
    dtype: str,
    device: str,
    weights: str,
    compile_step: bool | None,
    cache_type: str | None,
    lengths: str,
    decode_lengths: str,
    group_size: int,
    window: int,
    repeats: int,
    reference_max: int,
    ctx: int,
    endless_tokens: int,
    cases: str,
    forms: str,
    llama_server: str | None,
    parallel: int,
    cache_reuse: int,
    clients: int,
    requests: int,
    reply_tokens: int,
    turns: int,
    speculation: Speculation,
    out: str | None,
) -> None:
    """Time and memory of Self-Extend against plain SDPA attention and the full-matrix reference.

    Prefill: seconds and peak memory the forward adds (MiB). Decode: milliseconds per token at
    a cache length. Endless: tokens/s through a context-shift cache of --ctx tokens against
    plain decoding at the same average fill, resident memory at start and end, and the cost of
    one shift. Generate: tokens/s of greedy generation through the shift cache with int8 weights and (for a
    GGUF) int4 and gguf weights, each plain and with Self-Extend, against llama.cpp on the same GGUF (ratio
    column: to llama.cpp). Other ratios compare each variant with plain at the same length, in the same run.
    Server: selfextend serve and llama.cpp's llama-server on the same GGUF, slots, cells and threads, one at
    a time, rounds interleaved: aggregate tokens/s and time to first token under --clients streaming
    conversations, then a chat trimmed from the front (cache reuse); ours over theirs per round.
    """
    wanted = {c.strip() for c in cases.split(",") if c.strip()}
    unknown = wanted - {"prefill", "decode", "endless", "generate", "first-token", "server", "speculative"}
    if unknown:
        raise click.BadParameter(f"unknown case {', '.join(sorted(unknown))}", param_hint="--cases")
    if not wanted:
        raise click.BadParameter("names no case", param_hint="--cases")
    from selfextend.evaluation.lengths import parse_lengths  # (no torch: bad values said at once)

    prefill_lengths = parse_lengths(lengths, "--lengths")
    decode_at = parse_lengths(decode_lengths, "--decode-lengths")
    timed_forms = [f.strip() for f in forms.split(",") if f.strip()]
    if not timed_forms or set(timed_forms) - {"int8", "int4", "gguf"}:
        raise click.BadParameter(f"'{forms}': name int8, int4 or gguf, comma-separated", param_hint="--forms")
    if out:
        from selfextend.evaluation.results import repair_tail

        repair_tail(out)  # a file of another kind (notes.txt) refused before anything is measured
    if "server" in wanted:  # subprocesses, before this process holds a model
        given = click.get_current_context().get_parameter_source("weights")
        ours = weights if given != click.core.ParameterSource.DEFAULT else None
        load = {"parallel": parallel, "ctx": ctx, "cache_reuse": cache_reuse, "clients": clients}
        load.update(requests=requests, reply_tokens=reply_tokens, turns=turns)
        run_server_case(model, llama_server, ours, cache_type, repeats, out, **load)
        wanted.discard("server")
        if not wanted:
            return
    import psutil
    import torch

    from selfextend.bench.llamacpp import available as llamacpp_available
    from selfextend.bench.runner import (
        BenchConfig,
        MemoryMeter,
        bench_decode,
        bench_endless,
        bench_prefill,
        summarize,
    )
    from selfextend.bench.speed import bench_first_token, bench_generate, cpu_model
    from selfextend.cli.interrupts import prompt_interrupts
    from selfextend.cli.options import load_with_self_extend
    from selfextend.evaluation.memory import check_memory
    from selfextend.evaluation.methods import Method
    from selfextend.evaluation.results import append_jsonl, own_records
    from selfextend.generation.settings import decode_settings

    if out and Path(out).exists():  # its rows in a ppl file made that sweep refuse to resume
        own_records(out, "bench")

    cfg = BenchConfig(
        prefill_lengths,
        decode_at,
        group_size,
        window,
        repeats,
        reference_max=reference_max,
        endless_ctx=ctx,
        endless_tokens=endless_tokens,
        endless_keep=min(4, ctx - 2),
    )
    lm, tokenizer = load_with_self_extend(model, dtype, device, None, None, weights)
    cfg.compile, cache_dtype = decode_settings(lm, compile_step, cache_type)
    cfg.cache_type = cache_type
    from selfextend.hf.facts import trained_window

    checked_self_extend(group_size, window, trained_window(lm.config))
    timed = [*(prefill_lengths if "prefill" in wanted else ()), *(decode_at if "decode" in wanted else ())]
    warning = check_memory(lm, [(n, Method("plain")) for n in timed], cells="decode" in wanted)
    if warning:  # (past the memory there is: refused above, in one line naming --lengths)
        click.echo(f"warning: {warning}", err=True)
    proc = psutil.Process()
    device_name = (  # the machine of every row: the GPU's name, or the CPU's model and threads
        torch.cuda.get_device_name(lm.device)
        if lm.device.type == "cuda"
        else f"{cpu_model()}, {plural(torch.get_num_threads(), 'thread')}"
    )
    runs: list[dict] = []

    def record(r: dict) -> None:
        r.setdefault("weights", weights)  # generate and first-token runs name their variant's own
        r.update(model=model, dtype=dtype, device=device_name, group_size=group_size, window=window)
        runs.append(r)
        click.echo(
            "  "
            + " ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in r.items()
                if k not in ("model", "dtype", "weights", "device", "group_size", "window")
            ),
            err=True,
        )
        if out:
            append_jsonl(out, r)

    kept = f"; {out} keeps every row written" if out else ""
    with prompt_interrupts(lambda: f"interrupted inside a long forward pass: not waiting for it{kept}"):
        if "prefill" in wanted:  # (one forward of a long prompt: minutes in one operation on a CPU)
            for r in bench_prefill(lm, cfg, MemoryMeter(lm.device)):
                record(r)
        if "decode" in wanted:
            for r in bench_decode(lm, cfg):
                record(r)
    if "endless" in wanted and endless_tokens > 0:
        for r in bench_endless(lm, cfg, lambda: proc.memory_info().rss / 2**20):
            record(r)
    if wanted & {"generate", "first-token"}:
        from selfextend.models import resolve_model

        gguf = resolve_model(model).gguf_path
        if gguf is None or not llamacpp_available():
            click.echo("llama.cpp: skipped (needs a GGUF model and llama-cpp-python installed)", err=True)
        loaded = {}
        forms = timed_forms if gguf is not None else ("int8",)
        for form in forms if lm.device.type == "cpu" else (weights,):
            loaded[form] = (
                lm if form == weights else load_with_self_extend(model, dtype, device, None, None, form)[0]
            )
        if "generate" in wanted and endless_tokens > 0:
            for r in bench_generate(loaded, cfg, gguf, torch.get_num_threads()):
                record(r)
        if "first-token" in wanted:
            for r in bench_first_token(loaded, cfg, gguf, torch.get_num_threads()):
                record(r)
    if "speculative" in wanted and endless_tokens > 0:
        from selfextend.bench.speculative import bench_speculative

        draft = speculation.drafter(tokenizer, dtype, device, None, None, weights, cache_dtype)
        lookup = speculation.lookup or (0 if draft is not None else 8)
        for r in bench_speculative(lm, tokenizer, cfg, lookup, draft):
            record(r)
    readings = [r["read_bandwidth_gbs"] for r in runs if "read_bandwidth_gbs" in r]  # [before, after] each
    bandwidth = [min(lo for lo, _ in readings), max(hi for _, hi in readings)] if readings else None
    weights_said = ", ".join(
        [f"{weights} weights"] * bool(wanted & {"prefill", "decode", "endless", "speculative"})
        + ["generate: weights per variant"] * bool(wanted & {"generate", "first-token"})
    )
    click.echo(
        f"\n{model}, {dtype}, {weights_said}, {device_name}, G={group_size}, W={window}, "
        f"{plural(repeats, 'repeat')} (medians; prefill after one untimed warm-up run per variant), "
        f"{'compiled' if cfg.compile else 'eager'} decode, "
        + f"{str(cache_dtype or lm.dtype).removeprefix('torch.')} cache"
        + (f", machine read bandwidth {bandwidth[0]:.1f}-{bandwidth[1]:.1f} GB/s" if bandwidth else "")
    )
    click.echo(
        f"{'case':8} {'variant':15} {'length':>7} {'value':>12} {'ratio':>9} "
        f"{'peak MiB':>9} {'mem vs plain':>12} {'spread':>7} {'MB/tok':>7} {'GB/s':>6}"
    )
    units = {
        "prefill": ("seconds", "s"),
        "decode": ("ms_per_token", "ms/tok"),
        "endless": ("tokens_per_s", "tok/s"),
        "shift": ("ms_per_shift", "ms/shift"),
        "generate": ("tokens_per_s", "tok/s"),
        "first-token": ("seconds", "s"),
        "speculative": ("tokens_per_s", "tok/s"),
    }
    summary = summarize(runs)
    for row in summary:
        key, unit = units[row["case"]]
        engines = {
            r["prefill_engine"]
            for r in runs
            if "prefill_engine" in r
            and (r["case"], r["variant"], r["length"]) == (row["case"], row["variant"], row["length"])
        }
        if engines:  # which engine read the prompts (first-token rows of GGUF block layers)
            row["prefill_engine"] = ",".join(sorted(engines))
        around = [
            r["read_bandwidth_gbs"]
            for r in runs
            if "read_bandwidth_gbs" in r
            and (r["case"], r["variant"], r["length"]) == (row["case"], row["variant"], row["length"])
        ]
        if around:  # the bandwidth just before and after each of the row's timed runs: its range
            row["read_bandwidth_gbs"] = [min(lo for lo, _ in around), max(hi for _, hi in around)]
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else ""
        peak = f"{row['peak_mib']:.0f}" if "peak_mib" in row else ""
        mem = f"{row['memory_ratio']:.2f}x" if "memory_ratio" in row else ""
        spread = f"{row['spread']:.0%}" if "spread" in row else ""
        mb = f"{row['mb_per_token']:.0f}" if "mb_per_token" in row else ""
        gbs = f"{row['gb_per_s']:.1f}" if "gb_per_s" in row else ""
        click.echo(
            f"{row['case']:8} {row['variant']:15} {row['length']:>7} {row[key]:>8.3g} {unit:<6}"
            f"{ratio:>7} {peak:>9} {mem:>12} {spread:>7} {mb:>7} {gbs:>6}"
        )
        if out:
            append_jsonl(
                out,
                {
                    "summary": True,
                    "model": model,
                    "dtype": dtype,
                    "weights": weights,
                    "device": device_name,
                    **row,
                },
            )
    click.echo(
        "ratio: to plain at the same length (endless: to plain decoding at the average fill; "
        "generate: to llama.cpp); spread: (max - min) / median over the rounds; MB/tok: bytes a decode "
        "step reads at least (weights and the K/V cells at the average fill); GB/s: MB/tok x tok/s"
    )
    for row in summary:
        if row["case"] == "speculative" and row["variant"] != "plain":
            mine = [r for r in runs if r["case"] == "speculative" and r["variant"] == row["variant"]]
            same = all(r["identical"] for r in mine)
            click.echo(
                f"speculative {row['variant']}: {row['acceptance']:.0%} of the drafts kept, "
                f"{row['tokens_per_pass']:.2f} tokens per pass of the step, tokens "
                + ("identical to plain's in every round" if same else "NOT plain's in some round")
            )
    for row in summary:
        if len(row.get("round_ratios", ())) > 1:  # rounds interleaved: each its own ratio
            rounds = ", ".join(f"{x:.2f}x" for x in row["round_ratios"])
            click.echo(f"per round, to llama.cpp: {row['case']} {row['variant']} {row['length']}: {rounds}")
    if bandwidth:
        click.echo(
            f"machine read bandwidth: {bandwidth[0]:.1f}-{bandwidth[1]:.1f} GB/s ({torch.get_num_threads()} "
            "threads; STREAM-style reads just before and after each timed run, lowest to highest)"
        )
