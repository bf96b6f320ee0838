"""``selfextend serve``: the OpenAI-compatible server (thin: load, build the app, run uvicorn)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import click

from selfextend.cli.generation_options import (
    Speculation,
    cache_type_option,
    sampling_options,
    speculative_options,
)
from selfextend.cli.options import (
    COUNT,
    POSITIVE,
    cache_reuse_option,
    integer,
    model_options,
    parallel_option,
    self_extend_options,
    weights_option,
)

if TYPE_CHECKING:
    from selfextend.generation.sampling import SamplingParams


@click.command()
@model_options
@weights_option("auto")
@self_extend_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: all).")
@click.option("--port", type=integer(1, hi=65535), default=8080, show_default=True, help="TCP port.")
@click.option("-c", "--ctx", type=integer(16), default=2048, show_default=True, help="Cache cells per slot.")
@parallel_option(1)
@cache_reuse_option
@click.option(
    "-cram",
    "--cache-ram",
    type=COUNT,
    default=2048,
    show_default=True,
    help="MiB of cells kept in memory of conversations whose slot went to another, so that their next "
    "request reuses them instead of computing its prompt again (llama-server's --cache-ram; 0: none).",
)
@click.option(
    "--prefill-chunk",
    type=POSITIVE,
    default=512,
    show_default=True,
    help="Prompt tokens written per step between the running requests' tokens: a new prompt delays the "
    "streams already running by at most one such chunk per token (llama-server's --ubatch-size).",
)
@click.option(
    "--api-key",
    default=None,
    envvar="SELFEXTEND_API_KEY",
    help="Require 'Authorization: Bearer KEY' on every endpoint but /health and the chat page's files "
    "(also from $SELFEXTEND_API_KEY).",
)
@click.option(
    "--cors",
    "cors_origins",
    multiple=True,
    metavar="ORIGIN",
    callback=lambda ctx, param, value: tuple(_origin(v) for v in value),
    help="Let web pages of ORIGIN (as https://app.example:3000; '*': any) call the API from a browser "
    "(CORS headers and preflights); repeat for several. Off by default: only the chat page at / and "
    "clients outside a browser can call it (llama-server allows any origin).",
)
@click.option(
    "--max-tokens",
    type=POSITIVE,
    default=4096,
    show_default=True,
    help="The largest max_tokens a request may ask for (tokens).",
)
@click.option(
    "--max-prompt-tokens",
    type=POSITIVE,
    default=None,
    help="The longest prompt a request may send, in tokens (default: 4 x --ctx); a longer one is answered "
    "with a 400. Prompts longer than --ctx are read through context shifts.",
)
@click.option(
    "--slot-save-path",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder of slot files for POST /slots/ID?action=save|restore (off without it).",
)
@click.option(
    "--drain-timeout",
    type=COUNT,
    default=60,
    show_default=True,
    help="Seconds SIGTERM waits for requests in flight before it ends them (each with an error event).",
)
@cache_type_option
@speculative_options
@sampling_options
def serve(
    model: str,
    dtype: str,
    device: str,
    weights: str,
    group_size: int | None,
    window: int | None,
    host: str,
    port: int,
    ctx: int,
    parallel: int,
    cache_reuse: int,
    cache_ram: int,
    prefill_chunk: int,
    api_key: str | None,
    cors_origins: tuple[str, ...],
    max_tokens: int,
    max_prompt_tokens: int | None,
    slot_save_path: str | None,
    drain_timeout: int,
    cache_type: str | None,
    speculation: Speculation,
    sampling: SamplingParams,
    seed: int | None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, with a chat page at /.

    Each of the --parallel slots is a context-shift cache of --ctx cells; a request goes to the slot
    that already holds most of its prompt, and reuses the common prefix and (--cache-reuse) chunks the
    client moved forward by cutting old messages. Prompts longer than --ctx are read through context
    shifts that keep the system prompt. The sampling options are the defaults requests can override.
    SIGTERM or Ctrl-C stops taking requests, lets those in flight finish, then exits.

    \b
    Examples:
      selfextend serve --ctx 4096 --parallel 2
      curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hello"}]}'
    """
    import uvicorn

    from selfextend.cli.generate import warn_beyond_reach
    from selfextend.cli.options import load_with_self_extend
    from selfextend.generation.settings import decode_settings
    from selfextend.models.heap import bound_heap_growth
    from selfextend.server.app import Settings, create_app
    from selfextend.server.engine import Engine

    bound_heap_growth()
    if seed is not None:
        raise click.UsageError("--seed is per request here (the 'seed' field)")
    if slot_save_path:
        os.makedirs(slot_save_path, exist_ok=True)
    lm, tokenizer = load_with_self_extend(model, dtype, device, group_size, window, weights)
    warn_beyond_reach(lm, ctx, group_size, window)
    _, cache_dtype = decode_settings(lm, False, cache_type)  # the cells generate and chat use by default
    engine = Engine(
        lm,
        tokenizer,
        ctx,
        parallel,
        cache_reuse,
        prefill_chunk=prefill_chunk,
        cache_dtype=cache_dtype,
        cache_ram=cache_ram * 2**20,
        lookup=speculation.lookup,
        draft=speculation.drafter(tokenizer, dtype, device, group_size, window, weights, cache_dtype),
    )
    settings = Settings(
        model_name=model,
        api_key=api_key,
        max_tokens=max_tokens,
        default_max_tokens=min(512, max_tokens),
        max_prompt_tokens=max_prompt_tokens,
        sampling=sampling,
        slot_save_path=slot_save_path,
        cors_origins=cors_origins,
    )
    config = uvicorn.Config(
        create_app(engine, settings),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=drain_timeout,
    )
    server = _server(config, f"listening on http://{host}:{port} ({parallel} slots of {ctx} cells)")
    exit_code: list[int] = []

    def listen() -> None:
        try:
            server.run()
        except SystemExit as e:  # uvicorn's way of saying it could not start (the port is taken)
            exit_code.append(int(e.code or 1))
        finally:
            engine.stop()

    http = threading.Thread(target=listen, name="selfextend-http")
    asked: list[int] = []  # the signals that asked to stop (the handler only appends: no lock, no thread)

    def drain_deadline() -> None:
        """Just before uvicorn cancels what still runs at the drain's end (a stream cut off mid-way, a
        traceback logged), the engine ends each request with an error event: a stream gets it, then [DONE]."""
        while not asked:
            time.sleep(0.2)
        time.sleep(drain_timeout - min(1.0, drain_timeout / 4))
        engine.stop(now=True)

    def on_signal(sig, frame) -> None:
        server.handle_exit(sig, frame)  # stop taking requests; a second Ctrl-C cancels those running
        asked.append(sig)

    threading.Thread(target=drain_deadline, name="selfextend-drain", daemon=True).start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    http.start()
    try:
        engine.run_loop()  # the model runs on the thread that loaded it (engine.py says why)
    finally:
        server.should_exit = True
        http.join()
    if exit_code:
        sys.exit(exit_code[0])
    click.echo("stopped", err=True)


def _origin(value: str) -> str:
    """``value`` as the Origin header a browser sends (scheme://host[:port], no path), or ``*``: any other
    form would never match, and the pages it was meant for would be refused without a word."""
    from urllib.parse import urlsplit

    if value == "*":
        return value
    parts = urlsplit(value.strip())
    bare = parts.path in ("", "/") and not (parts.query or parts.fragment or parts.username)
    if parts.scheme not in ("http", "https") or not parts.hostname or not bare:
        raise click.BadParameter(f"{value!r} is not an origin such as https://app.example:3000 (or '*')")
    return f"{parts.scheme}://{parts.netloc}".lower()


def _server(config, ready: str):
    """uvicorn's server that says when it listens and leaves signals to the main thread (``serve`` hands
    SIGINT and SIGTERM to its ``handle_exit``); uvicorn's own handling would raise the signal again after
    draining, ending the process with the signal's status instead of 0."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                click.echo(ready, err=True)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(config)
