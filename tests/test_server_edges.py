"""The server at its edges, through a real loopback socket and the ``openai`` client (issue 42): a response
format meeting a logit bias that leaves no token, preparation off the event loop, deeply nested JSON,
the engine's loop ending, text held back for a stop string at the end of a reply."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from server_util import connect, request, serving

from selfextend.generation.text import TextStream
from selfextend.server import schemas

BOOL_A = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}},
    "required": ["a"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Is the sea blue? Answer as JSON."}]


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    with serving(model, tok, n_ctx=128, parallel=1, max_tokens=64) as (base, engine):
        yield base, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=60)


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}


def test_grammar_complete_with_every_end_banned_stops(server, client):
    """Item 1: a -100 bias on every end-of-sequence id: once ``{"a": true}`` is complete no token is left;
    the reply ends there with ``stop`` (was a 500), streamed or not."""
    bias = {str(t): -100 for t in server[1].eos}
    kwargs = dict(model="t", messages=ASK, max_tokens=32, temperature=0, logit_bias=bias)
    out = client.chat.completions.create(**kwargs, response_format=_format(BOOL_A))
    assert out.choices[0].finish_reason == "stop"
    assert json.loads(out.choices[0].message.content) in ({"a": True}, {"a": False})
    assert out.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(**kwargs, response_format=_format(BOOL_A), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content and chunks[-1].choices[0].finish_reason == "stop"


def test_grammar_needing_a_banned_character_ends_with_length(tiny, server, client):
    """Item 1: a bias banning every token holding the ``{`` the schema needs first: no token can start the
    reply; it ends empty with ``length`` (the document is not complete), and the server goes on."""
    _, tok = tiny
    braces = {str(i): -100 for i in range(len(tok)) if "{" in tok.decode([i])}
    out = client.chat.completions.create(
        model="t",
        messages=ASK,
        max_tokens=32,
        temperature=0.7,
        seed=1,
        extra_body={"top_k": 0},
        logit_bias=braces,
        response_format=_format(BOOL_A),
    )
    assert (out.choices[0].finish_reason, out.choices[0].message.content) == ("length", "")
    assert out.usage.completion_tokens == 0
    again = client.chat.completions.create(
        model="t", messages=ASK, max_tokens=32, temperature=0, response_format=_format(BOOL_A)
    )
    assert again.choices[0].finish_reason == "stop" and json.loads(again.choices[0].message.content)


def test_text_held_for_a_stop_string_is_kept_at_the_end(tiny, server, client):
    """Item 7: a reply of "\\n" then an end-of-sequence token (a +100 bias on "\\n", +90 on the end, a repeat
    penalty that sinks "\\n" once written) with ``stop: ["\\n\\n"]``: the "\\n" held as a possible start of
    the stop string is sent (it was dropped); the reply equals the one without the stop string."""
    _, tok = tiny
    (newline,) = tok("\n", add_special_tokens=False).input_ids
    bias = {str(newline): 100, str(server[1].eos[0]): 90}
    kwargs = dict(model="t", prompt="The sea", max_tokens=8, temperature=0, logit_bias=bias)
    extra = {"repeat_penalty": 2.0}
    plain = client.completions.create(**kwargs, extra_body=extra)
    assert (plain.choices[0].text, plain.choices[0].finish_reason) == ("\n", "stop")
    held = client.completions.create(**kwargs, stop=["\n\n"], extra_body=extra)
    assert (held.choices[0].text, held.choices[0].finish_reason) == ("\n", "stop")
    streamed = client.completions.create(**kwargs, stop=["\n\n"], extra_body=extra, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "\n"


NESTED = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", b'{"max_tokens": 1, "prompt": ' + NESTED + b"}"),
        ("/v1/chat/completions", b'{"messages": ' + NESTED + b"}"),
        ("/tokenize", b'{"content": ' + NESTED + b"}"),
        ("/slots/0?action=save", b'{"filename": ' + NESTED + b"}"),
    ],
    ids=["completions", "chat", "tokenize", "slots"],
)
def test_deeply_nested_json_is_a_400(server, path, body):
    """Item 3: 100,000 nested arrays (a RecursionError in the parser): a 400 ``invalid_json``, not a 500."""
    status, out = request(server[0], "POST", path, body)
    assert status == 400 and out["error"]["code"] == "invalid_json", out
    assert "nested too deep" in out["error"]["message"], out  # (it said "not valid JSON", which it is)
    assert request(server[0], "GET", "/health")[0] == 200


def test_logit_bias_keys_of_ascii_digits_alone_are_ids(tiny):
    """A key of ASCII digits alone is a token id; " 2024", "2024 " or Arabic-Indic digits are text (they
    were read as ids: ``{" 2024": -100}``, written as the docs teach " Paris", banned token 2024)."""
    _, tok = tiny

    def biased(key: str) -> dict[int, float]:
        return schemas.logit_bias(schemas.CompletionRequest(prompt="a", logit_bias={key: 5}), tok)

    for key in (" 42", "42 ", "\u0664\u0662", "+42"):
        assert biased(key) == dict.fromkeys(tok(key, add_special_tokens=False).input_ids, 5.0), key
    assert biased("42") == biased("0042") == {42: 5.0}


@pytest.mark.parametrize(
    "fields,said",
    [
        ({"response_format": _format(BOOL_A), "json_schema": {"type": "integer"}}, "give the schema once"),
        ({"response_format": {"type": "json_object"}, "json_schema": BOOL_A}, "give the schema once"),
        ({"response_format": _format(False)}, "needs a schema object in json_schema.schema, got false"),
        (
            {"messages": [{"role": "user", "content": [{"text": "hi"}]}]},
            'a part is an object such as {"type"',
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 'a text part needs its "text"'),
    ],
    ids=["format-and-schema", "object-and-schema", "schema-false", "part-without-type", "part-without-text"],
)
def test_fields_that_contradict_or_lack_a_part_are_400s_that_say_so(server, fields, said):
    """Two schemas at once were resolved silently (response_format won); a part without a type was "not
    None parts", one without text "Input should be a valid string"."""
    body = {"messages": ASK, "max_tokens": 4, "temperature": 0} | fields
    status, out = request(server[0], "POST", "/v1/chat/completions", body)
    assert status == 400 and said in out["error"]["message"], out


def test_schema_true_is_any_json_document(client):
    """JSON Schema's ``true`` (any document) is taken (it was "needs json_schema.schema")."""
    out = client.chat.completions.create(
        model="t", messages=ASK, max_tokens=24, temperature=0, response_format=_format(True)
    )
    if out.choices[0].finish_reason == "stop":
        json.loads(out.choices[0].message.content)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_a_405_names_the_methods_and_a_429_says_when_to_retry(server):
    """A 405 carries ``Allow`` (RFC 9110); a full queue's 429 ``Retry-After`` (they had neither)."""
    base, engine = server
    conn = connect(base)
    conn.request("GET", "/v1/chat/completions")
    answer = conn.getresponse()
    answer.read()
    assert answer.status == 405 and "POST" in answer.getheader("Allow", ""), answer.headers
    engine.max_queue, before = 0, engine.max_queue
    try:
        body = json.dumps({"prompt": "The sea", "max_tokens": 2}).encode()
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        assert answer.status == 429 and json.loads(answer.read())["error"]["code"] == "queue_full"
        assert answer.getheader("Retry-After") == "1", answer.headers
    finally:
        engine.max_queue = before
        conn.close()


class _Gate:
    """A stand-in for a slow call: it waits until released, saying when it has started."""

    def __init__(self, call) -> None:
        self.call, self.entered, self.release = call, threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.release.wait(20)
        return self.call(*args, **kwargs)


@pytest.mark.parametrize("slow", ["logit_bias", "grammar", "pieces"])
def test_health_answers_while_a_request_is_prepared(tiny, server, slow, monkeypatch):
    """Item 2: while a request's logit bias is tokenised, its schema compiled or /tokenize's pieces decoded
    (held here until released), /health answers at once: that work runs off the event loop."""
    base, _ = server
    _, tok = tiny
    if slow == "pieces":
        gate = _Gate(tok.decode)
        monkeypatch.setattr(tok, "decode", gate)
        path, body = "/tokenize", {"content": "The sea is blue", "with_pieces": True}
    else:
        gate = _Gate(getattr(schemas, "logit_bias" if slow == "logit_bias" else "Grammar"))
        monkeypatch.setattr(schemas, "logit_bias" if slow == "logit_bias" else "Grammar", gate)
        path = "/v1/chat/completions"
        body = {"messages": ASK, "max_tokens": 2, "temperature": 0}
        body |= (
            {"logit_bias": {" blue": -100}} if slow == "logit_bias" else {"response_format": _format(BOOL_A)}
        )
    answers = []
    sender = threading.Thread(target=lambda: answers.append(request(base, "POST", path, body)))
    sender.start()
    try:
        assert gate.entered.wait(30)
        t0 = time.perf_counter()
        status, health = request(base, "GET", "/health", timeout=10)
        waited = time.perf_counter() - t0
    finally:
        gate.release.set()
        sender.join(60)
    assert status == 200 and health["status"] == "ok" and waited < 5, waited
    assert answers and answers[0][0] == 200, answers


def test_a_failure_after_the_first_token_ends_only_its_request(tiny):
    """Item 5: an error while the first token's text is made (outside the model) ends that request with an
    error; the loop goes on and the next request is answered (it used to end the loop for everyone)."""
    model, tok = tiny
    with serving(model, tok, n_ctx=64, parallel=1) as (base, engine):
        real, calls = TextStream.push, [0]

        def push(self, token):
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("injected failure")
            return real(self, token)

        TextStream.push = push
        try:
            body = {"prompt": "The sea", "max_tokens": 4, "temperature": 0}
            status, out = request(base, "POST", "/v1/completions", body, timeout=20)
            assert status == 500 and "injected failure" in out["error"]["message"], out
            status, out = request(base, "POST", "/v1/completions", body, timeout=20)
        finally:
            TextStream.push = real
        assert status == 200 and out["choices"][0]["finish_reason"] in ("length", "stop")
        assert engine.thread.is_alive() and not engine.closed


def test_requests_after_the_loop_ended_are_refused(tiny):
    """Item 5: once the engine's loop has ended, a request is answered at once with a 503 (it used to wait
    for good) and /health says so."""
    model, tok = tiny
    with serving(model, tok, n_ctx=64, parallel=1) as (base, engine):
        engine.stop()
        assert engine.closed
        body = {"prompt": "The sea", "max_tokens": 4}
        status, out = request(base, "POST", "/v1/completions", body, timeout=10)
        assert status == 503 and out["error"]["type"] == "server_error", out
        status, out = request(base, "GET", "/health", timeout=10)
        assert status == 503 and out["status"] == "error", out


def test_a_reply_the_stop_cut_short_is_a_503(tiny):
    """A plain (not streamed) request still running when the server stops at once (SIGTERM past the drain
    timeout) is answered 503 "the server is stopping", as a request that comes after; it was a 500
    "generation failed"."""
    model, tok = tiny
    with serving(model, tok, n_ctx=64, parallel=1) as (base, engine):
        body = {"prompt": "The sea", "max_tokens": 2000, "ignore_eos": True}
        asked = threading.Thread(target=lambda: got.append(request(base, "POST", "/v1/completions", body)))
        got: list = []
        asked.start()
        while not any(s.busy for s in engine.slots):
            time.sleep(0.01)
        engine.stop(now=True)
        asked.join(30)
    status, out = got[0]
    assert status == 503 and out["error"]["message"] == "the server is stopping", out
    assert out["error"]["type"] == "server_error" and out["error"]["code"] == "unavailable"


def test_a_token_id_past_the_table_is_a_400(tiny):
    """Issue 49: raw prompt ids are held to the rows the embedding table stores, not only to the tokenizer's
    size. A GGUF whose vocabulary is longer than its table is refused at load, but a model put together
    otherwise (here a Q8_0 block table of 16 rows fewer than the tokenizer) may still hold one: an id past its
    rows is a 400 naming the range, and an id inside it is answered."""
    import gguf
    import torch

    from selfextend.models.blocks import BlockEmbedding

    model, tok = tiny
    inner, before = model.model, model.model.embed_tokens
    rows = len(tok) - 16
    raw = gguf.quants.quantize(before.weight[:rows].numpy(), gguf.GGMLQuantizationType.Q8_0)
    inner.embed_tokens = BlockEmbedding(torch.from_numpy(raw), 8, before.embedding_dim)
    try:
        with serving(model, tok, n_ctx=64, parallel=1) as (base, engine):
            assert engine.vocab == rows
            for ids in ([5, rows], [len(tok) - 1], [rows + 4_000_000]):
                body = {"prompt": ids, "max_tokens": 2}
                status, out = request(base, "POST", "/v1/completions", body, timeout=30)
                assert status == 400 and f"[0, {rows})" in out["error"]["message"], out
            status, out = request(base, "POST", "/v1/completions", {"prompt": [5, rows - 1], "max_tokens": 2})
            assert status == 200, out
    finally:
        inner.embed_tokens = before
