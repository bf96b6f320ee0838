"""Running the server for tests: in this process on a free loopback port, or as a ``selfextend serve``."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import urlsplit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if request(base, "GET", "/health", timeout=1)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"no server at {base}")


def connect(base: str, timeout: float = 60) -> http.client.HTTPConnection:
    url = urlsplit(base)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)


def request(
    base: str,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    headers: dict | None = None,
    timeout=60,
) -> tuple[int, dict | str]:
    """(status, JSON body or text) of one plain HTTP request."""
    conn = connect(base, timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, text


def side_by_side(engine, calls: Sequence[Callable[[], None]], timeout: float = 90) -> None:
    """Run ``calls`` (each sends one request) on threads of their own, the engine held until all their
    requests are queued, so that it takes them together."""
    gate = threading.Event()
    with engine.wake:
        engine.tasks.append(lambda: gate.wait(60))
        engine.wake.notify()
    threads = [threading.Thread(target=call) for call in calls]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(engine.queue) < len(calls) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        gate.set()
    for t in threads:
        t.join(timeout)


@contextmanager
def serving(
    model,
    tokenizer,
    n_ctx=128,
    parallel=1,
    cache_reuse=4,
    prefill_chunk=512,
    cache_ram=0,
    lookup=0,
    **settings,
) -> Iterator[tuple]:
    """(base URL, engine) of a server in a thread of this process; stopped at the end. ``cache_ram``:
    bytes of the prompt store (0: none); ``lookup``: drafts per pass by prompt lookup."""
    import uvicorn

    from selfextend.server.app import Settings, create_app
    from selfextend.server.engine import Engine

    engine = Engine(
        model,
        tokenizer,
        n_ctx,
        parallel,
        cache_reuse,
        prefill_chunk=prefill_chunk,
        cache_ram=cache_ram,
        lookup=lookup,
    )
    app = create_app(engine, Settings(**{"model_name": "tiny", **settings}))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    engine.start()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 30)
        yield base, engine
    finally:
        server.should_exit = True
        thread.join(30)
        engine.stop()


@contextmanager
def serve_process(*args: str, env: dict | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base URL, process) of ``selfextend serve ARGS`` on a free port; killed at the end if still running."""
    port = free_port()
    cmd = [sys.executable, "-m", "selfextend", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 300, proc)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
