"""``selfextend generate``: stream text from a fixed-size, context-shifting KV cache, forever if asked."""

from __future__ import annotations

import json
import sys
import time

import click

from cli.options import COUNT, SEED, integer, model_options, number, self_extend_options, weights_option


@click.command()
@model_options
@weights_option("int8")
@self_extend_options
@click.option("-p", "--prompt", help="Prompt text. Default: --prompt-file, else standard input.")
@click.option(
    "-f", "--prompt-file", type=click.Path(dir_okay=False), help="Read the prompt from this UTF-8 file."
)
@click.option("--system", help="System prompt; kept through every context shift.")
@click.option(
    "--chat/--no-chat",
    default=True,
    show_default=True,
    help="Wrap the prompt in the model's chat template (when it has one).",
)
@click.option(
    "-c",
    "--ctx",
    type=integer(2),
    default=2048,
    show_default=True,
    help="KV cache capacity in tokens; when full, the older half after --keep is dropped.",
)
@click.option(
    "--keep",
    type=integer(-1),
    default=None,
    help="Tokens kept at every shift. Default: BOS + the system prompt; -1: the whole prompt.",
)
@click.option(
    "-n",
    "--max-new-tokens",
    type=integer(-1),
    default=256,
    show_default=True,
    help="Tokens to generate; -1 goes on until Ctrl-C (with --ignore-eos, forever).",
)
@click.option("--ignore-eos", is_flag=True, help="Do not stop at end-of-sequence tokens.")
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")
@click.option("--temperature", type=number(0.0), default=0.8, show_default=True, help="0 = greedy.")
@click.option(
    "--top-k", type=COUNT, default=40, show_default=True, help="Keep the k most likely tokens (0 = off)."
)
@click.option(
    "--top-p",
    type=number(0.0, 1.0, lo_open=True),
    default=0.95,
    show_default=True,
    help="Nucleus: smallest set with this mass.",
)
@click.option(
    "--min-p",
    type=number(0.0, 1.0, hi_open=True),
    default=0.05,
    show_default=True,
    help="Drop tokens below this fraction of the top token's probability.",
)
@click.option(
    "--repeat-penalty",
    type=number(0.0, lo_open=True),
    default=1.0,
    show_default=True,
    help="Penalty for tokens among the last --repeat-last-n (1 = off).",
)
@click.option(
    "--repeat-last-n",
    type=integer(-1),
    default=64,
    show_default=True,
    help="Window of the repeat penalty, tokens (0 = no penalty, -1 = the whole context).",
)
@click.option("--seed", type=SEED, default=None, help="Random seed for sampling (default: random).")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    help="Also append the generated text to this file, flushed as tokens arrive.",
)
@click.option(
    "--prompt-cache",
    type=click.Path(dir_okay=False),
    help="Save the KV cache after the prompt here; reuse it when a later prompt starts the same.",
)
@click.option(
    "--stats-every",
    type=COUNT,
    default=0,
    help="Every N tokens, print a JSON line on stderr: tokens, tokens/s over the last N, RSS MiB.",
)
def generate(
    model: str,
    dtype: str,
    device: str,
    weights: str,
    group_size: int | None,
    window: int | None,
    prompt: str | None,
    prompt_file: str | None,
    system: str | None,
    chat: bool,
    ctx: int,
    keep: int | None,
    max_new_tokens: int,
    ignore_eos: bool,
    stop: tuple[str, ...],
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repeat_penalty: float,
    repeat_last_n: int,
    seed: int | None,
    output: str | None,
    prompt_cache: str | None,
    stats_every: int,
) -> None:
    """Generate text, shifting the context when the cache is full, so it never stops for lack of room.

    Examples:

      selfextend generate -p "Tell me a story." -n -1 --ignore-eos --ctx 1024

      selfextend generate --system "Answer as a pirate." -f question.txt -g 4 -w 1024 --ctx 16384
    """
    import psutil

    from cli.options import load_with_self_extend
    from selfextend.cache import ContextShiftCache
    from selfextend.corpus import read_stdin, read_text_file
    from selfextend.generate import Generator, StopMatcher, TextStream, build_prompt, run
    from selfextend.sampling import SamplingParams

    if keep is not None and keep >= ctx:
        raise click.BadParameter(f"--keep ({keep}) must be smaller than --ctx ({ctx})", param_hint="--keep")
    if prompt is None:
        prompt = read_text_file(prompt_file) if prompt_file else read_stdin()
    if not prompt.strip():
        raise click.UsageError("empty prompt: give --prompt, --prompt-file or text on standard input")
    sampling = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n)
    sampling.validate()

    lm, tokenizer = load_with_self_extend(model, dtype, device, group_size, window, weights)
    _warn_beyond_reach(lm, ctx, group_size, window)
    ids, n_system = build_prompt(tokenizer, prompt, system, chat)
    n_keep = len(ids) if keep == -1 else (n_system if keep is None else keep)
    if n_keep >= ctx - 1:
        raise click.BadParameter(
            f"keeping {n_keep} tokens leaves no room in a cache of {ctx}; raise --ctx or lower --keep",
            param_hint="--keep",
        )
    cache = ContextShiftCache(lm, n_ctx=ctx, n_keep=n_keep)
    gen = Generator(lm, cache, sampling, seed)
    reused, reused_logits = 0, None
    if prompt_cache:
        from pathlib import Path

        from selfextend import promptcache

        if Path(prompt_cache).exists():
            gen.tokens, reused_logits = promptcache.load(prompt_cache, lm, cache, ids)
            reused = len(gen.tokens)

    eos = () if ignore_eos else tuple(_eos_ids(lm, tokenizer))
    stream, stops = TextStream(tokenizer), StopMatcher(stop)
    out_file = open(output, "a", encoding="utf-8") if output else None  # noqa: SIM115 (closed below)
    proc = psutil.Process()
    stats = None
    last_mark = (0, time.perf_counter())

    def emit(text: str) -> None:
        if text:
            click.echo(text, nl=False)
            sys.stdout.flush()
            if out_file:
                out_file.write(text)
                out_file.flush()

    try:
        for token, stats in run(gen, ids, max_new_tokens, eos, reused, reused_logits):
            if stats.tokens == 1 and prompt_cache and cache.shifts == 0 and reused < len(ids):
                from selfextend import promptcache

                promptcache.save(prompt_cache, lm, cache, gen.tokens[: len(ids)], gen.last_logits)
            text, stopped = stops.push(stream.push(token))
            emit(text)
            if stats_every and stats.tokens % stats_every == 0:
                now = time.perf_counter()
                rate = (stats.tokens - last_mark[0]) / (now - last_mark[1])
                last_mark = (stats.tokens, now)
                click.echo(
                    json.dumps(
                        {
                            "tokens": stats.tokens,
                            "tokens_per_s": round(rate, 2),
                            "rss_mib": round(proc.memory_info().rss / 2**20, 1),
                            "shifts": stats.shifts,
                            "n_past": stats.n_past,
                        }
                    ),
                    err=True,
                )
            if stopped:
                stats.stop_reason = "stop string"
                break
        else:
            if stats is not None and not stats.stop_reason:
                stats.stop_reason = "max tokens" if stats.tokens == max_new_tokens else "end of sequence"
        emit(stops.flush())
    except KeyboardInterrupt:
        if stats is not None:
            stats.stop_reason = "interrupted"
    finally:
        if out_file:
            out_file.close()
    click.echo("", err=False)
    if stats is not None:
        click.echo(stats.summary(), err=True)


def _warn_beyond_reach(model, ctx: int, group_size: int | None, window: int | None) -> None:
    """A cache larger than what the model can attend over well is allowed, but said."""
    from selfextend.patch import max_usable_length, trained_window

    trained = trained_window(model.config)
    if group_size is None and ctx > trained:
        click.echo(
            f"warning: --ctx {ctx} exceeds the trained window ({trained} tokens); quality drops past it "
            "unless Self-Extend is on (-g/-w)",
            err=True,
        )
    elif group_size is not None and ctx > (reach := max_usable_length(model, group_size, window)):
        click.echo(
            f"warning: --ctx {ctx} exceeds what G={group_size}, W={window} reach ({reach} tokens)", err=True
        )


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
