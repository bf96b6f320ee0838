"""``selfextend chat``: a conversation that goes on through context shifts, like llama-cli's -cnv."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from selfextend.cli.generation_options import Speculation, generation_options
from selfextend.cli.options import replaceable_file
from selfextend.core.validate import first_line, plural

if TYPE_CHECKING:
    from selfextend.chat import ChatSession
    from selfextend.generation.sampling import SamplingParams

HELP = """commands:
  /help          this list
  /save FILE     save the whole session (cache, history, settings) to FILE
  /load FILE     continue the session saved in FILE (same model and settings only)
  /reset         start over (same system prompt)
  /system TEXT   start over with a new system prompt
  /stats         tokens, shifts, cache fill, tokens/s
  /undo          drop the last exchange (your turn and the reply)
  /retry         generate the last reply again
  /quit          end the session (as Ctrl-D)
A line ending in \\ continues on the next line; one starting with // is sent with one / less.
Ctrl-C stops a reply; at an empty prompt it ends."""


class _Terminate(Exception):
    """SIGTERM at the prompt: end the session as Ctrl-D would."""


@click.command()
@generation_options("auto")
@click.option(
    "--session",
    "session_file",
    type=click.Path(dir_okay=False),
    callback=replaceable_file,
    help="Session file: resumed at the start if it exists, with the model, --ctx, --keep, system prompt, "
    "-g/-w, --weights and --cache-type it was saved with (a flag that contradicts them is refused); "
    "written at the end (also on SIGTERM).",
)
@click.option(
    "-q", "--quiet", is_flag=True, help="No context-shift notes, no prompt progress bar, no banner."
)
def chat(
    model: str,
    dtype: str,
    device: str,
    weights: str,
    group_size: int | None,
    window: int | None,
    system: str | None,
    system_file: str | None,
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
    stats_every: int,
    session_file: str | None,
    quiet: bool,
) -> None:
    """Chat with the model: each line you type is a user turn; the reply streams as it is generated.

    The conversation runs in one fixed-size cache: when it is full, the oldest whole exchanges after
    the system prompt are dropped (the system prompt stays), so a chat never ends for lack of room.
    Type /help at the prompt for the commands. When standard input is not a terminal, every line
    is one turn and every reply is followed by a blank line.

    Examples:

      selfextend chat --system "You are a pirate." --ctx 1024

      printf 'Hi\\nWhat did I say?\\n' | selfextend chat -n 64 --temperature 0

      selfextend chat --session talk.pt    # resumes where the last run ended, with its settings
    """
    from selfextend.chat import ChatSession, ShiftReport
    from selfextend.cli.generate import warn_beyond_reach
    from selfextend.cli.generation_options import check_cache, system_prompt
    from selfextend.cli.interrupts import held_interrupts
    from selfextend.cli.options import load_with_self_extend
    from selfextend.cli.resume import in_use, model_id, resume
    from selfextend.cli.stream import Output, prefill_bar
    from selfextend.generation.settings import decode_settings

    system = system_prompt(system, system_file)
    if session_file and Path(session_file).exists():  # its settings, unless a flag contradicts them
        given = dict(
            model=model,
            dtype=dtype,
            weights=weights,
            group_size=group_size,
            window=window,
            ctx=ctx,
            keep=keep,
            system=system,
            cache_type=cache_type,
            sampling=sampling,
        )
        model, dtype, weights, group_size, window, ctx, keep, system, cache_type, sampling = resume(
            session_file, given
        ).values()
    check_cache(ctx, keep)
    lm, tokenizer = load_with_self_extend(model, dtype, device, group_size, window, weights)
    warn_beyond_reach(lm, ctx, group_size, window)
    out = Output(output, stats_every)
    notes: list[str] = []  # context-shift notes, printed by the Repl before or after a reply, never inside

    def on_shift(r: ShiftReport) -> None:
        if quiet:
            return
        if r.whole and not r.exchanges:  # up to the next exchange: the rest of one whose start went before
            what = f"dropped the rest of an exchange cut before, {plural(r.tokens, 'token')}"
        elif r.whole:
            what = f"dropped {plural(r.exchanges, 'old exchange')}, {plural(r.tokens, 'token')}"
        else:
            what = f"dropped {plural(r.tokens, 'token')}, cutting through a turn"
        notes.append(f"[context shift: {what}; cache {r.n_past}/{ctx}]")

    compile_step, cache_dtype = decode_settings(lm, compile_step, cache_type)
    session = ChatSession(
        lm,
        tokenizer,
        ctx,
        system=system,
        keep=keep,
        sampling=sampling,
        seed=seed,
        max_new_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
        stops=stop,
        on_shift=on_shift,
        progress=lambda n: prefill_bar(n, quiet),
        compile=compile_step,
        cache_dtype=cache_dtype,
        model_name=model_id(model),
        lookup=speculation.lookup,
        draft=speculation.drafter(tokenizer, dtype, device, group_size, window, weights, cache_dtype),
    )
    if session_file and Path(session_file).exists():
        session.load(session_file)
        if seed is not None:  # the sampler goes on from the file's random state unless --seed says otherwise
            session.gen.rng.manual_seed(seed)
        if not quiet:
            click.echo(f"resumed {session_file} ({in_use(session)}): {_fill(session)}", err=True)
    saved = True
    repl = Repl(session, out, quiet, sys.stdin.isatty(), notes)
    try:
        repl.run()
    finally:  # whatever ended the session (EOF, /quit, Ctrl-C, SIGTERM, an error), its file is written,
        with held_interrupts() as came:  # a Ctrl-C while it is written waits for it
            if session_file:
                saved = _save(session, session_file, quiet)
            out.close()
            click.echo(summary(session), err=True)
    if came or repl.terminated:  # as generate's: a script sees the stop (143 for SIGTERM, 130 for Ctrl-C)
        sys.exit(128 + (came[0] if came else signal.SIGTERM))
    if not saved:
        sys.exit(1)


def _save(session: ChatSession, path: str, quiet: bool) -> bool:
    """Write the session to ``path``; a failure is one line (the run may be ending on another error). Where
    another chat wrote the file since this one read it, this conversation goes to a file beside it (named
    by this process) rather than over the other's."""
    from selfextend.chat import ChatError
    from selfextend.chat.session import FileChangedError

    try:
        session.save(path)
    except FileChangedError as e:
        beside = Path(path).with_name(f"{Path(path).stem}.{os.getpid()}{Path(path).suffix}")
        saved = _save(session, str(beside), quiet=True)
        click.echo(f"error: {first_line(e)}" + (f"; this one saved to {beside}" if saved else ""), err=True)
        return False
    except ChatError as e:
        click.echo(f"error: {first_line(e)}", err=True)
        return False
    if not quiet:
        click.echo(f"saved the session to {path}", err=True)
    return True


def _fill(session: ChatSession) -> str:
    return f"{plural(len(session.exchanges), 'exchange')}, cache {session.cache.n_past}/{session.n_ctx}"


def summary(session: ChatSession) -> str:
    """The closing line (and /stats): replies, tokens, rates, shifts, cache fill, and with drafts
    (--lookup, --draft-model) the drafts kept of those checked in this run, as generate's line."""
    st, cache, gen = session.stats, session.cache, session.gen
    drafts = f", drafts kept {gen.kept}/{gen.drafted}" if gen.drafted else ""
    return (
        f"{plural(st.replies, 'reply', 'replies')}, {plural(st.tokens, 'token')} in {st.seconds:.1f} s "
        f"({st.rate(st.tokens, st.seconds):.2f} tokens/s; last reply {plural(st.last_tokens, 'token')}, "
        f"{st.rate(st.last_tokens, st.last_seconds):.2f} tokens/s), "
        f"prompt {plural(st.prompt_tokens, 'token')} in {st.prompt_seconds:.1f} s, "
        f"{plural(cache.shifts, 'context shift')} ({plural(session.ledger.dropped_exchanges, 'exchange')}, "
        f"{plural(cache.discarded, 'token')} dropped), "
        f"cache {cache.n_past}/{cache.n_ctx}, {cache.n_keep} kept{drafts}"
    )


def _typed() -> str:
    """The text on the prompt's line when Ctrl-C came: readline's buffer (none without readline)."""
    readline = sys.modules.get("readline")
    return readline.get_line_buffer() if readline is not None else ""


class Repl:
    """The read-eval-print loop: turns, commands, Ctrl-C and SIGTERM."""

    def __init__(
        self, session: ChatSession, out, quiet: bool, interactive: bool, notes: list[str] | None = None
    ) -> None:
        self.session, self.out, self.quiet, self.interactive = session, out, quiet, interactive
        self.notes = notes if notes is not None else []
        self.reading = False
        self.terminated = False
        self.lines_read = 0  # lines of input so far: a piped line no tokenizer takes is named by its number

    def run(self) -> None:
        if self.interactive:
            try:
                import readline  # noqa: F401 (line editing and history for input())
            except ImportError:
                pass
            if not self.quiet:
                click.echo(
                    f"chatting in a cache of {self.session.n_ctx} tokens, {self.session.n_keep} kept; "
                    "/help for commands, Ctrl-C stops a reply, Ctrl-D ends",
                    err=True,
                )
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            while not self.terminated:
                try:
                    line = self._read()
                except (EOFError, _Terminate):
                    break
                if line is None:
                    break
                if line.strip() and not self._handle(line):
                    break
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _on_sigterm(self, signum, frame) -> None:
        self.terminated = True
        self.session.stop_requested = True  # a reply stops at its next token
        if self.reading:
            raise _Terminate

    def _on_sigint(self, signum, frame) -> None:
        self.session.stop_requested = True

    def _read(self) -> str | None:
        """One user turn: lines ending in a backslash continue. None: Ctrl-C at an empty prompt; with text
        typed (or a turn begun) Ctrl-C clears it, as a shell does."""
        lines: list[str] = []
        while True:
            self.reading = True
            try:
                line = input(("... " if lines else "> ") if self.interactive else "")
                self.lines_read += 1
            except KeyboardInterrupt:
                click.echo("", err=True)
                if not lines and not _typed():
                    return None
                lines = []
                continue
            except EOFError:
                if lines:
                    return "\n".join(lines)
                if self.interactive:
                    click.echo("", err=True)  # the summary goes below the prompt, not after it
                raise
            finally:
                self.reading = False
            if line.endswith("\\"):
                lines.append(line[:-1])
                continue
            lines.append(line)
            return "\n".join(lines)

    def _handle(self, line: str) -> bool:
        """Run a command or answer a turn; False ends the session. A command that fails says why in one
        line and the session goes on: a typo in a file name must not lose the conversation."""
        from selfextend.chat import ChatError

        s = self.session
        if line.startswith("//") or not line.lstrip().startswith("/"):
            text = line[1:] if line.startswith("//") else line  # "//" sends a line that starts with "/"
            try:
                self._stream(s.reply(text))
            except ChatError as e:  # text no tokenizer takes: at a prompt it is said, from a pipe it ends
                if not self.interactive:
                    raise ChatError(f"input line {self.lines_read}: {e}") from None
                click.echo(f"error: {e}; not sent", err=True)
            return not self.terminated
        command, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        try:
            if command in ("/quit", "/exit"):
                return False
            if command == "/help":
                click.echo(HELP, err=True)
            elif command == "/stats":
                click.echo(summary(s), err=True)
            elif command == "/reset":
                s.start(s.system)
                self._say("started over")
            elif command == "/system":
                if not arg:
                    raise ChatError("/system needs the new system prompt")
                s.start(arg)
                self._say(f"started over with the new system prompt ({s.n_keep} tokens kept)")
            elif command == "/undo":
                before = s.cache.n_past
                gone = s.undo()
                seen = gone.start is not None or s.cache.n_past != before
                where = "" if seen else " (shifted out of the cache already)"
                self._say(f"dropped the last exchange{where}; {_fill(s)}")
            elif command == "/retry":
                self._stream(s.retry())
                return not self.terminated
            elif command in ("/save", "/load"):
                if not arg:
                    raise ChatError(f"{command} needs a file name")
                if command == "/save":
                    s.save(arg)
                    self._say(f"saved the session to {arg}")
                else:
                    s.load(arg)
                    self._say(f"loaded {arg}: {_fill(s)}")
            else:
                raise ChatError(f"unknown command {command}; /help lists them")
        except Exception as e:  # noqa: BLE001 (any command's failure is reported, never ends the chat)
            click.echo(f"error: {first_line(e)}", err=True)
        return True

    def _say(self, text: str) -> None:
        if not self.quiet:
            click.echo(text, err=True)

    def _stream(self, pieces) -> None:
        """Print a reply as it comes; Ctrl-C stops it at the next token (the cache stays consistent)."""
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        self.out.restart_rate()
        n = 0
        try:
            for text in pieces:
                if n == 0:
                    self._notes()  # shifts made while the turn was written come before the reply
                self.out.text(text)
                n += 1
                self.out.tokens(n, self.session.cache.shifts, self.session.cache.n_past)
        finally:
            signal.signal(signal.SIGINT, previous)
        if self.session.stop_requested and not self.terminated and not self.quiet:
            self.out.note("[stopped]")
        self.out.text("\n" if self.interactive else "\n\n")
        self._notes()  # shifts made while the reply streamed come after it

    def _notes(self) -> None:
        for line in self.notes:
            self.out.note(line)
        self.notes.clear()
