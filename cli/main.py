"""``selfextend``: the command group. Each command parses, calls the library, prints.

Bad input of any kind (flags, models, files, parameters) ends as one line on stderr and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import warnings

import click

from selfextend.cli.bench import bench
from selfextend.cli.cache import cache
from selfextend.cli.chat import chat
from selfextend.cli.generate import generate
from selfextend.cli.info import info
from selfextend.cli.measure import passkey, ppl
from selfextend.cli.options import Terminated, interrupt_status, quiet_openmp_waits
from selfextend.cli.report import plot, table
from selfextend.cli.serve import serve
from selfextend.core.paths import cache_root
from selfextend.core.validate import first_line


def _interrupt(signum, frame) -> None:
    raise Terminated


class _StderrLines(logging.Handler):
    """The library's INFO messages (a first GGUF conversion) as plain lines on the current stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(self.format(record), err=True)


def _log_to_stderr() -> None:
    logger = logging.getLogger("selfextend")
    if not any(isinstance(h, _StderrLines) for h in logger.handlers):
        logger.addHandler(_StderrLines())
        logger.setLevel(logging.INFO)


_SHOWN: set[str] = set()  # the warnings said in this command: a results file read twice is said once


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one ``warning: ...`` line on stderr (no source line, no file position), each once, on a
    line of its own where a tqdm progress bar is drawn (cleared, then drawn again below it)."""
    text = f"warning: {first_line(message if isinstance(message, Warning) else Warning(message))}"
    if text in _SHOWN:
        return
    _SHOWN.add(text)
    if "tqdm" not in sys.modules:
        click.echo(text, err=True)
        return
    from tqdm import tqdm

    with tqdm.external_write_mode(file=sys.stderr):
        click.echo(text, err=True)


class Group(click.Group):
    """A click group whose errors are one line: ``error: ...`` on stderr, exit status 2."""

    def main(self, *args, **kwargs):  # noqa: D102
        kwargs["standalone_mode"] = False
        quiet_openmp_waits(os.environ)  # before any option or command imports torch
        warnings.showwarning = _warning_line
        _SHOWN.clear()
        _log_to_stderr()
        previous = None
        if threading.current_thread() is threading.main_thread():
            # SIGTERM stops like Ctrl-C (summary, output flushed); given back afterwards, so a caller that
            # runs the group in its own process (click's CliRunner) keeps its handler
            previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.exceptions.NoArgsIsHelpError as e:  # a group without a command: its whole help
            click.echo(e.format_message(), err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            hint = (
                f" (see '{e.ctx.command_path} --help')" if isinstance(e, click.UsageError) and e.ctx else ""
            )
            click.echo(f"error: {first_line(click.ClickException(e.format_message()))}{hint}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort as e:
            click.echo("aborted", err=True)
            sys.exit(interrupt_status(e.__cause__))
        except (ValueError, NotImplementedError, OSError, RuntimeError, ArithmeticError) as e:
            click.echo(f"error: {first_line(e)}", err=True)
            sys.exit(2)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="selfextend")
def main() -> None:
    """Self-Extend attention and context shift for Hugging Face RoPE language models.

    Read past the trained context window without fine-tuning, or generate forever in a
    fixed-size KV cache. MODEL is `smollm2-135m` (the embedded default), a .gguf file, a
    transformers model directory or a Hugging Face hub id.
    """
    root = cache_root()
    if root.exists() and not root.is_dir():  # every GGUF load and kernel build would fail on it, each its way
        raise ValueError(f"the cache root {root} is not a folder: set SELFEXTEND_CACHE to a folder")


main.add_command(info)
main.add_command(generate)
main.add_command(chat)
main.add_command(ppl)
main.add_command(passkey)
main.add_command(plot)
main.add_command(table)
main.add_command(bench)
main.add_command(cache)
main.add_command(serve)
