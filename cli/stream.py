"""Terminal output shared by ``generate`` and ``chat``: streamed text, stats lines, the prefill bar."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

PROGRESS_MIN_TOKENS = 256  # prompts shorter than this prefill in a blink: no bar


class OutputFileError(click.ClickException):
    """The ``-o`` file could not be written (a full disk, a quota): named, so the one-line error says which
    file, not only an errno."""

    def __init__(self, path: str, error: OSError) -> None:
        super().__init__(f"cannot write {path}: {error.strerror or error}")
        self.path = path


class Output:
    """Streamed text on stdout (and appended to ``path``, flushed as it goes), notes on stderr.

    When stdout and stderr are the same terminal, a note printed mid-line would land inside the
    text, so a note then starts on a new line of its own.
    """

    def __init__(self, path: str | None = None, stats_every: int = 0) -> None:
        import psutil

        self.path = path
        self.file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 (closed in close())
        self.stats_every = stats_every
        self.proc = psutil.Process()
        self.shared_screen = sys.stdout.isatty() and sys.stderr.isatty()
        self.at_line_start = True
        self.mark = (0, time.perf_counter())

    def text(self, text: str) -> None:
        if not text:
            return
        try:
            click.echo(text, nl=False)
            sys.stdout.flush()
        except BrokenPipeError:  # the reader gone: the caller's own stop (generate: exit 141)
            raise
        except OSError as e:  # a full disk behind `> file`: named as -o's is; the rest of the run's
            # writes (and the exit's flush) go nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise OutputFileError("standard output", e) from None
        self.at_line_start = text.endswith("\n")
        if self.file:
            self._write(text)

    def _write(self, text: str) -> None:
        """Append to the file now; the first failure closes it (nothing more is tried) and is raised."""
        try:
            self.file.write(text)
            self.file.flush()
        except OSError as e:
            file, self.file = self.file, None
            try:
                file.close()
            except OSError:  # the same unwritable bytes, still buffered
                pass
            raise OutputFileError(self.path, e) from None

    def note(self, line: str) -> None:
        """One line on stderr, never inside a line of streamed text on a shared terminal."""
        if self.shared_screen and not self.at_line_start:
            click.echo("", err=True)
            self.at_line_start = True
        click.echo(line, err=True)

    def rss_mib(self) -> float:
        return self.proc.memory_info().rss / 2**20

    def restart_rate(self, tokens: int = 0) -> None:
        """Start the next tokens/s interval now, ``tokens`` in (after a prefill, or at a new reply)."""
        self.mark = (tokens, time.perf_counter())

    def tokens(self, tokens: int, shifts: int, n_past: int) -> None:
        """Every ``stats_every`` tokens: a JSON line with the rate over them (null where none was made since
        the last mark: the first token comes with the prompt), RSS, shifts and cache fill."""
        if not self.stats_every or tokens % self.stats_every:
            return
        now = time.perf_counter()
        made = tokens - self.mark[0]
        rate = round(made / max(now - self.mark[1], 1e-9), 2) if made > 0 else None
        self.mark = (tokens, now)
        record = {
            "tokens": tokens,
            "tokens_per_s": rate,
            "rss_mib": round(self.rss_mib(), 1),
            "shifts": shifts,
            "n_past": n_past,
        }
        self.note(json.dumps(record))

    def close(self) -> None:
        """Close the file, ended with a newline where the text did not end with one: the next run appends
        on a line of its own (two runs' texts ran together)."""
        if self.file:
            if self.file.tell() and not self.at_line_start:
                self._write("\n")
            self.file.close()
            self.file = None


@contextmanager
def prefill_bar(n_tokens: int, quiet: bool = False) -> Iterator[Callable[[int], object] | None]:
    """A tqdm bar (tokens/s, ETA) on stderr while a prompt long enough to make a user wait is written.

    Yields the bar's ``update`` (call it with the tokens just written), or None for no bar.
    """
    if quiet or n_tokens < PROGRESS_MIN_TOKENS or not sys.stderr.isatty():  # no redrawn frames in a log
        yield None
        return
    from tqdm import tqdm

    with tqdm(
        total=n_tokens, unit="tok", desc="prompt", leave=False, dynamic_ncols=True, file=sys.stderr
    ) as bar:
        yield bar.update
