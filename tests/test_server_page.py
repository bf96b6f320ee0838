"""The chat page in a real headless Chromium (Debian's package), driven over the DevTools protocol:
load it, send two messages, see the reply stream in, stop the second one. Skips, saying why, where no
chromium is on PATH: ``make test`` installs no system package (``.ci/run``, on a throwaway machine, does).

``SELFEXTEND_SCREENSHOT=PATH`` also saves the screenshot there (the tests otherwise write only under
their tmp folder)."""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from server_util import free_port, request, serving
from transformers import AutoTokenizer, LlamaForCausalLM

import selfextend

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium on PATH, so the chat page is not driven in a browser (apt-get install chromium)",
)
PAGE_JS = Path(selfextend.__file__).parent / "server" / "page" / "chat.js"


class Browser:
    """One page of a headless Chromium, through its DevTools websocket."""

    def __init__(self, profile: str) -> None:
        import websocket

        port = free_port()
        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                f"--user-data-dir={profile}",
                f"--remote-debugging-port={port}",
                "--window-size=1000,800",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as r:
                    pages = [t for t in json.load(r) if t["type"] == "page"]
                if pages:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not start")
            time.sleep(0.2)
        self.ws = websocket.create_connection(
            pages[0]["webSocketDebuggerUrl"], timeout=30, suppress_origin=True
        )
        self.ids = itertools.count(1)

    def call(self, method: str, **params) -> dict:
        n = next(self.ids)
        self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == n:
                if "error" in message:
                    raise RuntimeError(message["error"])
                return message["result"]

    def js(self, expression: str):
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in out:
            raise RuntimeError(out["exceptionDetails"])
        return out["result"].get("value")

    def wait(self, expression: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.js(expression):
            if time.monotonic() > deadline:
                raise TimeoutError(expression)
            time.sleep(0.05)

    def close(self) -> None:
        self.ws.close()
        self.proc.kill()
        self.proc.wait()


def send(browser: Browser, text: str, max_tokens: int) -> None:
    browser.js(
        f"document.getElementById('max-tokens').value = {max_tokens};"
        f"document.getElementById('input').value = {json.dumps(text)};"
        "document.getElementById('form').requestSubmit();"
    )


def _tiny(tiny_dir) -> tuple:
    model = LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(tiny_dir), "tiny"


def _smollm2(tiny_dir) -> tuple:
    from selfextend.models import load_model

    return (*load_model("smollm2-135m", weights="int8"), "smollm2-135m")


@pytest.mark.skipif(shutil.which("node") is None, reason="no node here")
def test_stats_line_counts_in_singular_and_plural():
    """The line under a reply says "1 token" and "1 context shift", not "1 tokens" (node runs the page's
    own functions, taken out of chat.js)."""
    source = PAGE_JS.read_text(encoding="utf-8")
    functions = "\n".join(
        re.search(rf"^function {f}\(.*?^}}", source, re.S | re.M)[0] for f in ("plural", "statsText")
    )
    stats = {"tokens_per_second": 2.5, "ttft_s": 0.25, "cached_tokens": 1, "moved_tokens": 0, "slot": 0}
    script = functions + "".join(
        f"\nconsole.log(statsText({json.dumps({**stats, 'shifts': n})}, {n}));" for n in (1, 2)
    )
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=60, check=True)
    one, two = out.stdout.splitlines()
    assert one.startswith("1 token, ") and ", 1 context shift, 1 prompt token reused" in one, one
    assert two.startswith("2 tokens, ") and ", 2 context shifts, " in two, two


@needs_chromium
@pytest.mark.parametrize(
    "load", [_tiny, pytest.param(_smollm2, marks=pytest.mark.real)], ids=["tiny", "real"]
)
def test_chat_page_streams_and_stops(load, tiny_dir, tmp_path):
    """The page on a tiny random model and on the real default model (whose screenshot shows real text)."""
    model, tok, name = load(tiny_dir)
    with serving(model, tok, n_ctx=512, max_tokens=4000, model_name=name) as (base, engine):
        browser = Browser(str(tmp_path / "profile"))
        try:
            browser.call("Page.enable")
            browser.call("Page.navigate", url=base + "/")
            browser.wait("document.readyState === 'complete' && document.getElementById('model').textContent")
            browser.js("document.getElementById('system').value = 'You are a terse pirate.'")
            # greedy: a sampled reply could hold " error" or end (EOS) before the stop button is pressed
            browser.js("document.getElementById('temperature').value = 0")
            replies = "document.querySelectorAll('.msg.assistant')"
            stats = "document.querySelectorAll('.stats')"

            send(browser, "Hello, who are you?", 24)
            browser.wait(f"{stats}.length === 1")
            first = browser.js(f"{replies}[0].textContent")
            assert first and not browser.js(f"{replies}[0].classList.contains('error')")
            assert "tokens/s" in browser.js(f"{stats}[0].textContent")

            send(browser, "Tell me a very long story.", 4000)
            # text arrives while the reply is still being generated (the stop button is live)
            browser.wait(f"{replies}[1].textContent.length > 20 && !document.getElementById('stop').disabled")
            seen = browser.js(f"{replies}[1].textContent")
            browser.wait(f"{replies}[1].textContent.length > {len(seen)}")  # and keeps arriving
            browser.js("document.getElementById('stop').click()")
            browser.wait("!document.getElementById('send').disabled")
            stopped = browser.js(f"{replies}[1].textContent")
            time.sleep(0.3)
            assert browser.js(f"{replies}[1].textContent") == stopped  # nothing after the stop
            assert "stopped" in browser.js(f"{stats}[1].textContent")
            deadline = time.monotonic() + 10
            while request(base, "GET", "/health")[1]["slots_processing"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert request(base, "GET", "/health")[1]["slots_processing"] == 0
            assert browser.js(f"{replies}.length") == 2
            shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
            (tmp_path / "chat_page.png").write_bytes(shot)
            if os.environ.get("SELFEXTEND_SCREENSHOT"):
                with open(os.environ["SELFEXTEND_SCREENSHOT"], "wb") as f:
                    f.write(shot)
        finally:
            browser.close()


@needs_chromium
def test_cors_lets_only_the_named_origin_call_the_api(tiny_dir, tmp_path):
    """``serve --cors ORIGIN``: a page of that origin calls the API from a real browser, its preflight (the
    key's header makes one) answered outside the key check; a page of another origin is refused by the
    browser (as every origin is without ``--cors``: no CORS headers at all)."""
    import http.server
    import threading

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "index.html").write_text("<html><body>another origin</body></html>")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "site"))  # noqa: E731
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    port = site.server_address[1]
    model, tok, _ = _tiny(tiny_dir)
    call = (
        "window.out = null; fetch('{base}/v1/completions', {{method: 'POST', headers: {{'Content-Type': "
        "'application/json', 'Authorization': 'Bearer k'}}, body: JSON.stringify({{prompt: 'Hi', "
        "max_tokens: 3}})}}).then(r => r.json())"
        ".then(j => {{ window.out = 'ok ' + j.usage.completion_tokens; }},"
        " e => {{ window.out = 'refused ' + e; }})"
    )
    browser = Browser(str(tmp_path / "profile"))
    try:
        with serving(model, tok, api_key="k", cors_origins=(f"http://127.0.0.1:{port}",)) as (base, _):
            for page, allowed in ((f"http://127.0.0.1:{port}/", True), (f"http://localhost:{port}/", False)):
                browser.call("Page.navigate", url=page)
                browser.wait("document.readyState === 'complete' && document.body.textContent.length > 0")
                browser.js(call.format(base=base))
                browser.wait("window.out !== null")
                out = browser.js("window.out")
                assert out.startswith("ok 3" if allowed else "refused TypeError"), (page, out)
    finally:
        browser.close()
        site.shutdown()


@needs_chromium
def test_a_refused_message_stays_out_of_the_conversation(tiny_dir, tmp_path):
    """Sent without the server's key: the error is shown on a line of its own and neither the message nor
    the error text joins the conversation (the error was sent back as the assistant's turn, and the model
    repeated it); with the key typed, the next message is answered alone. An empty temperature is said,
    not sent as 0. "New chat" during a reply leaves nothing of it (its text reached the next request)."""
    model, tok, name = _tiny(tiny_dir)
    with serving(model, tok, n_ctx=512, max_tokens=4000, model_name=name, api_key="k") as (base, engine):
        browser = Browser(str(tmp_path / "profile"))
        try:
            browser.call("Page.enable")
            browser.call("Page.navigate", url=base + "/")
            ready = "document.readyState === 'complete' && document.getElementById('model').textContent"
            browser.wait(f"{ready}.includes('needs an API key')")
            browser.js("document.getElementById('temperature').value = 0")
            send(browser, "hi", 8)
            browser.wait("document.querySelectorAll('.msg.error').length === 1")
            assert "invalid or missing API key" in browser.js(
                "document.querySelector('.msg.error').textContent"
            )
            assert (
                browser.js("turns.length") == 0
                and browser.js("document.querySelectorAll('.unsent').length") == 1
            )
            browser.js(
                "const k = document.getElementById('key'); k.value = 'k'; k.dispatchEvent(new Event('input'))"
            )
            browser.wait("document.getElementById('model').textContent.startsWith('tiny')")
            send(browser, "Hello", 8)
            browser.wait("document.querySelectorAll('.stats').length === 1")
            turns = browser.js("turns")
            assert [t["role"] for t in turns] == ["user", "assistant"] and turns[0]["content"] == "Hello"
            assert "error" not in turns[1]["content"]

            browser.js("document.getElementById('temperature').value = ''")
            send(browser, "  indented", 8)
            browser.wait("document.querySelectorAll('.msg.error').length === 2")
            assert "Temperature must be a number" in browser.js(
                "[...document.querySelectorAll('.msg.error')].pop().textContent"
            )
            assert browser.js("document.getElementById('input').value") == "  indented"  # kept, not sent

            browser.js("document.getElementById('temperature').value = 0")
            send(browser, "Tell me a very long story.", 4000)
            browser.wait("[...document.querySelectorAll('.msg.assistant')].pop().textContent.length > 5")
            browser.js("document.getElementById('clear').click()")
            browser.wait("!document.getElementById('send').disabled")
            time.sleep(0.3)
            assert (
                browser.js("turns.length") == 0
                and browser.js("document.getElementById('log').children.length") == 0
            )
        finally:
            browser.close()
