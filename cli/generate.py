"""``selfextend generate``: stream text from a fixed-size, context-shifting KV cache, forever if asked."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import click

from selfextend.cli.generation_options import Speculation, generation_options
from selfextend.cli.options import Terminated, device_map_option, in_writable_folder, interrupt_status

if TYPE_CHECKING:
    from selfextend.generation.sampling import SamplingParams


@click.command()
@generation_options("auto")
@device_map_option
@click.option("-p", "--prompt", help="Prompt text. Default: --prompt-file, else standard input.")
@click.option(
    "-f", "--prompt-file", type=click.Path(dir_okay=False), help="Read the prompt from this UTF-8 file."
)
@click.option(
    "--chat/--no-chat",
    default=True,
    show_default=True,
    help="Wrap the prompt in the model's chat template (when it has one).",
)
@click.option(
    "--prompt-cache",
    type=click.Path(dir_okay=False),
    callback=in_writable_folder,
    help="Save the KV cache after the prompt here; reuse it when a later prompt starts the same.",
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
    system_file: str | None,
    chat: bool,
    ctx: int,
    keep: int | None,
    compile_step: bool | None,
    cache_type: str | None,
    speculation: Speculation,
    max_new_tokens: int,
    ignore_eos: bool,
    stop: tuple[str, ...],
    sampling: SamplingParams,
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
    from selfextend.cli.generation_options import check_cache, check_keep, kept_part, system_prompt
    from selfextend.cli.options import load_with_self_extend
    from selfextend.cli.stream import Output, OutputFileError, prefill_bar
    from selfextend.core.validate import first_line
    from selfextend.evaluation.corpus import read_stdin, read_text_file
    from selfextend.generation.generator import GenerationStats, Generator, run
    from selfextend.generation.settings import decode_settings
    from selfextend.generation.text import StopMatcher, TextStream, build_prompt, eos_token_ids
    from selfextend.kv.cache import ContextShiftCache, default_keep

    check_cache(ctx, keep)
    system = system_prompt(system, system_file)
    if prompt is None and not prompt_file and sys.stdin.isatty():
        click.echo("reading the prompt from standard input: type it, then Ctrl-D (or give -p TEXT)", err=True)
    if prompt is not None and prompt_file:  # the file was ignored without a word
        raise click.UsageError("give the prompt once: --prompt or --prompt-file, not both")
    if prompt is None:
        prompt = read_text_file(prompt_file) if prompt_file else read_stdin()
    if not prompt.strip():
        raise click.UsageError("empty prompt: give --prompt, --prompt-file or text on standard input")

    lm, tokenizer = load_with_self_extend(model, dtype, device, group_size, window, weights)
    warn_beyond_reach(lm, ctx, group_size, window)
    ids, n_system = build_prompt(tokenizer, prompt, system, chat)
    # --keep counts prompt tokens, at most the whole prompt (as llama.cpp's and our server's n_keep)
    n_keep = len(ids) if keep == -1 else (default_keep(n_system, len(ids), ctx) if keep is None else keep)
    n_keep = min(n_keep, len(ids))
    check_keep(n_keep, ctx, kept_part(system, chat, tokenizer) if keep is None and n_system else None)
    if len(ids) > ctx:
        click.echo(
            f"note: the prompt's {len(ids):,} tokens are more than --ctx {ctx:,} cells: it is read through "
            "context shifts, and the reply sees its kept start and its last tokens only",
            err=True,
        )
    compile_step, cache_dtype = decode_settings(lm, compile_step, cache_type)
    cache = ContextShiftCache(lm, n_ctx=ctx, n_keep=n_keep, dtype=cache_dtype)
    draft = speculation.drafter(tokenizer, dtype, device, group_size, window, weights, cache_dtype)
    gen = Generator(lm, cache, sampling, seed, compile=compile_step, lookup=speculation.lookup, draft=draft)
    reused, reused_logits = 0, None
    if prompt_cache:
        from pathlib import Path

        from selfextend.kv import promptcache

        if Path(prompt_cache).exists() and len(ids) > ctx:  # its cells would shift at other places than
            # a prompt read whole (the reply then differs from the one without the file): read as without it
            click.echo(
                f"note: --prompt-cache {prompt_cache} not read: the prompt goes through context shifts",
                err=True,
            )
        elif Path(prompt_cache).exists():
            gen.tokens, reused_logits = promptcache.load(prompt_cache, lm, cache, ids)
            reused = len(gen.tokens)

    eos = () if ignore_eos else eos_token_ids(lm, tokenizer)
    stream, stops = TextStream(tokenizer), StopMatcher(stop, tokenizer)
    out = Output(output, stats_every)
    stats = None

    def save_prompt_cache() -> None:
        """Written once the prompt is read; a file that cannot be written is said, and the run goes on."""
        if not prompt_cache or reused >= len(ids):
            return
        if cache.shifts:
            out.note(
                f"note: --prompt-cache {prompt_cache} not written: the prompt went through context shifts"
            )
            return
        from selfextend.kv import promptcache

        try:
            promptcache.save(prompt_cache, lm, cache, gen.tokens[: len(ids)], gen.last_logits)
        except (OSError, RuntimeError) as e:  # torch's writer says a failed open as a RuntimeError
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).rsplit("strerror: ", 1)[-1]
            out.note(f"warning: --prompt-cache {prompt_cache} not written: {first_line(why)}")

    def prompt_only(reason: str, read_tokens: int | None = None) -> GenerationStats:
        """The summary of a run that made no token: the prompt's tokens read (all unless told), time, shifts
        and cache fill."""
        return GenerationStats(
            prompt_tokens=len(ids) if read_tokens is None else read_tokens,
            reused_tokens=reused,
            prompt_seconds=time.perf_counter() - t0,
            shifts=cache.shifts,
            n_past=cache.n_past,
            n_ctx=ctx,
            stop_reason=reason,
        )

    t0 = time.perf_counter()
    read = [0]  # prompt tokens written in this run
    stopped_by: KeyboardInterrupt | None = None
    closed = False  # standard output closed under us (a pipe's reader gone)
    failed: OutputFileError | None = None  # the -o file could not be written
    try:
        with prefill_bar(len(ids) - reused) as bar:

            def progress(n: int) -> None:
                read[0] += n
                if bar is not None:
                    bar(n)

            tokens = run(gen, ids, max_new_tokens, eos, reused, reused_logits, progress)
            first = next(tokens, None)
        if first is None and max_new_tokens == 0:  # only the prompt was asked for: its summary all the same
            save_prompt_cache()
            stats = prompt_only("max tokens")
        out.restart_rate(1 if first else 0)
        for token, stats in itertools.chain([first] if first else [], tokens):
            if stats.tokens == 1:
                save_prompt_cache()
            text, stopped = stops.push(stream.push(token), token)
            out.text(text)
            out.tokens(stats.tokens, stats.shifts, stats.n_past)
            if stopped:
                stats.stop_reason = "stop string"
                break
        else:
            if stats is not None and not stats.stop_reason:
                stats.stop_reason = "max tokens" if stats.tokens == max_new_tokens else "end of sequence"
        out.text(stops.flush())
    except KeyboardInterrupt as e:
        stopped_by = e
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        if stats is None:  # while the prompt was read: said all the same (it ended on the progress bar)
            done = reused + read[0]
            stats = prompt_only(f"{how} while reading the prompt ({done:,} of {len(ids):,} tokens)", done)
        else:
            stats.stop_reason = how
    except BrokenPipeError:  # `| head`: the reader is gone; said on stderr, and a script sees it (141)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's flush at exit: no error)
        closed = True
        if stats is not None:
            stats.stop_reason = "standard output was closed"
    except OutputFileError as e:
        failed = e
    finally:
        try:
            out.close()
        except OutputFileError as e:
            failed = failed or e
    if failed is not None and stats is not None:
        stats.stop_reason = f"{failed.path} could not be written"
    if not closed and not out.at_line_start:  # the text's last line ended (no text: no blank line)
        click.echo("", err=False)
    if stats is not None:
        click.echo(stats.summary(), err=True)
    if failed is not None:
        raise failed
    if stopped_by is not None:  # a script sees the stop, as after a sweep's: 130 for Ctrl-C, 143 for SIGTERM
        sys.exit(interrupt_status(stopped_by))
    if closed:
        sys.exit(128 + signal.SIGPIPE)  # what a shell reports for a writer killed by SIGPIPE


def warn_beyond_reach(model, ctx: int, group_size: int | None, window: int | None) -> None:
    """A cache larger than what the model can attend over well is allowed, but said."""
    from selfextend.hf.facts import trained_window
    from selfextend.hf.patch import check_reach

    trained = trained_window(model.config)
    if group_size is None and ctx > trained:
        click.echo(
            f"warning: --ctx {ctx} exceeds the trained window ({trained} tokens); quality drops past it "
            "unless Self-Extend is on (-g/-w)",
            err=True,
        )
    elif group_size is not None:  # said by the library, once: not again when the cache is made
        check_reach(model, ctx, "--ctx of")
