"""``selfextend serve`` through the real ``openai`` client and plain HTTP, on a tiny random model with the
default model's tokenizer and chat template: answers against a plain greedy loop over the model's
forward, reuse counts against token prefixes computed here, auth, refusals, disconnects, slots."""

from __future__ import annotations

import json
import re
import signal
import stat
import subprocess
import sys
import threading
import time

import openai
import pytest
import torch
from server_util import connect, request, serve_process, serving, side_by_side

import selfextend
from selfextend.generation.text import eos_token_ids


@pytest.fixture(scope="module")
def slots(tmp_path_factory):
    """The server's slot folder."""
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def server(tiny, slots):
    model, tok = tiny
    with serving(model, tok, n_ctx=256, parallel=2, max_tokens=64, slot_save_path=str(slots)) as (
        base,
        engine,
    ):
        yield base, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def greedy(model, tok, ids: list[int], n: int) -> str:
    """The reference: n greedy steps, each a fresh forward over everything so far (no cache)."""
    eos, out = eos_token_ids(model, tok), []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if t in eos:
                break
            out.append(t)
    return tok.decode(out, skip_special_tokens=True)


def chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"  # GET /v1/models/tiny
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    status, body = request(server[0], "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["slots_idle"] == 2


def test_completion_matches_greedy_reference(client, tiny):
    model, tok = tiny
    prompt = "The sea is"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == greedy(model, tok, tok(prompt).input_ids, 12)
    assert out.usage.prompt_tokens == len(tok(prompt).input_ids)
    assert out.choices[0].finish_reason in ("length", "stop")
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_chat_stream_and_reuse_counts(client, tiny):
    model, tok = tiny
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours of the sea at dawn."},
    ]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    ids = chat_ids(tok, messages)
    assert first.choices[0].message.content == greedy(model, tok, ids, 10)
    assert first.usage.prompt_tokens == len(ids)
    # the same conversation one turn on: everything up to the reply is in the slot's cache
    reply = first.choices[0].message.content
    longer = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "And at dusk?"}]
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=longer,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    new_ids = chat_ids(tok, longer)
    assert text == greedy(model, tok, new_ids, 10)
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(new_ids)
    # the cache holds the first prompt and the reply: at least what the two prompts share is reused
    shared = 0
    while shared < min(len(ids), len(new_ids)) and ids[shared] == new_ids[shared]:
        shared += 1
    assert shared >= len(ids) - 2  # the template re-renders the end of the first prompt at most
    assert shared <= usage.prompt_tokens_details.cached_tokens < len(new_ids)


def test_sse_framing_ends_with_done(server):
    conn = connect(server[0])
    body = {"prompt": "Once", "max_tokens": 4, "stream": True, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    events = [e for e in response.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("length", "stop") and "selfextend" in last


def test_front_trimmed_chat_moves_chunks(client, tiny):
    """A client that cuts the oldest exchange: the exchanges after it are reused by K-shift."""
    _, tok = tiny
    system = {"role": "system", "content": "Remember everything."}
    turns = []
    for i in range(4):
        turns += [
            {
                "role": "user",
                "content": f"Fact number {i}: the harbour has {i + 3} red boats and a lighthouse.",
            },
            {"role": "assistant", "content": f"Noted fact {i}, about {i + 3} boats."},
        ]
    full = [system, *turns, {"role": "user", "content": "Which fact came first?"}]
    client.chat.completions.create(
        model="tiny", messages=full, max_tokens=2, temperature=0, extra_body={"id_slot": 0}
    )
    trimmed = [system, *turns[2:], {"role": "user", "content": "Which fact came first?"}]
    out = client.chat.completions.create(
        model="tiny", messages=trimmed, max_tokens=2, temperature=0, extra_body={"id_slot": 0}
    )
    ids, old = chat_ids(tok, trimmed), chat_ids(tok, full)
    prefix = 0
    while old[prefix] == ids[prefix]:
        prefix += 1
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert out.model_extra["selfextend"]["moved_tokens"] > 0
    assert prefix + 40 < cached <= len(ids)  # the three later exchanges came back by moving


def test_parallel_requests_decode_together_and_match_alone(tiny, client):
    """Two slots decoding in one batched step give each request the text it gets alone (Self-Extend on:
    its grouped keys are per cache). Both requests are queued before the engine takes either, so they
    run side by side."""
    model, tok = tiny
    prompts = ["A quiet harbour at night", "Numbers: one two three four"]
    with selfextend.self_extend(model, group_size=2, window=8):
        alone = [greedy(model, tok, tok(p).input_ids, 16) for p in prompts]
        with serving(model, tok, n_ctx=64, parallel=2, max_tokens=64) as (base, engine):
            step = engine.slots[0].backends.rows  # the direct step all slots share
            rows, sizes = step.rows, []

            def counted(tokens, *args):
                sizes.append(len(tokens))
                return rows(tokens, *args)

            step.rows = counted
            c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
            results: dict[int, str] = {}

            def ask(i: int) -> None:
                results[i] = (
                    c.completions.create(model="t", prompt=prompts[i], max_tokens=16, temperature=0)
                    .choices[0]
                    .text
                )

            try:
                side_by_side(engine, [lambda i=i: ask(i) for i in range(2)])
            finally:
                del step.rows
    assert [results[0], results[1]] == alone
    assert sizes.count(2) >= 10  # the two replies' tokens came out of shared steps


def test_extreme_but_valid_numbers_do_not_fail(client):
    """Found by schemathesis: a denormal temperature or top_p used to overflow the sampler (a 500)."""
    extras = (
        {"temperature": 5e-324},
        {"top_p": 5e-324, "temperature": 1},
        {"top_p": 0},
        {"repeat_penalty": 0.01},
    )
    for extra in extras:
        out = client.completions.create(model="tiny", prompt="Edge", max_tokens=3, extra_body=extra)
        assert out.usage.completion_tokens >= 1


def test_seeded_sampling_repeats(client):
    kwargs = dict(model="tiny", prompt="Sampling", max_tokens=12, temperature=1.0, top_k=20, seed=7)
    a = client.completions.create(
        **{k: v for k, v in kwargs.items() if k != "top_k"}, extra_body={"top_k": 20}
    )
    b = client.completions.create(
        **{k: v for k, v in kwargs.items() if k != "top_k"}, extra_body={"top_k": 20}
    )
    assert a.choices[0].text == b.choices[0].text


def test_stop_string_ends_the_reply(client, tiny):
    model, tok = tiny
    full = greedy(model, tok, tok("The sea is").input_ids, 12)
    stop = full[3:6]
    out = client.completions.create(
        model="tiny", prompt="The sea is", max_tokens=12, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_a_special_token_stop_ends_the_reply(client, tiny):
    """A stop string that is a special token's text (left out of the reply's text) stops at that token."""
    file_sep = tiny[1].convert_tokens_to_ids("<file_sep>")
    kwargs = dict(model="tiny", prompt="The sea is", max_tokens=4, temperature=0, logit_bias={file_sep: 100})
    stopped = client.completions.create(**kwargs, stop=["<file_sep>"]).choices[0]
    assert (stopped.text, stopped.finish_reason) == ("", "stop")
    assert client.completions.create(**kwargs).choices[0].finish_reason == "length"  # not the EOS


BAD = [
    (b"{not json", None),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "temperature": -1}', "temperature"),
    (b'{"prompt": "x", "top_p": 1.5}', "top_p"),
    (b'{"prompt": "x", "repeat_penalty": 5e-324}', "repeat_penalty"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 65}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
    (b'{"prompt": "x", "seed": -3}', "seed"),
    (b'{"prompt": "x", "n": 2}', "n"),
    (b'{"prompt": "x", "stop": 5}', "stop"),
    (json.dumps({"prompt": "x", "stop": [f"s{i}" for i in range(65)]}).encode(), "stop"),
    (b'{"prompt": "x", "modalities": ["text", "audio"]}', "modalities"),
    (b'{"prompt": "x", "audio": {"voice": "alloy", "format": "wav"}}', "audio"),
    (b'{"prompt": "x", "speculative": {"n_max": -1}}', "speculative"),
    (b'{"prompt": "x", "speculative": {"n_min": 2}}', "speculative"),
    (b'{"prompt": "x", "speculative": 5}', "speculative"),
    (b'{"prompt": "x", "speculative": {"n_max": 2}, "speculative.n_max": 3}', "speculative"),
    (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
    (b'{"prompt": ""}', "prompt"),
    (b'{"prompt": [1, 99999999]}', "prompt"),
    (b'{"prompt": "x", "frequency_penalty": 3}', "frequency_penalty"),
    (b'{"prompt": "x", "id_slot": 9}', "id_slot"),
    (b"[1, 2]", None),
    (b"{}", "prompt"),
    (b'{"prompt": "x", "logit_bias": {"5": 101}}', "logit_bias"),
    (b'{"prompt": "x", "logit_bias": {"99999999": -100}}', "logit_bias"),
    (b'{"prompt": "x", "logit_bias": [[5, 1, 2]]}', "logit_bias"),
    (b'{"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}', "tools"),
    (b'{"prompt": "x", "tool_choice": "required"}', "tool_choice"),
    (b'{"prompt": "x", "functions": [{"name": "f"}]}', "functions"),
    (b'{"prompt": "x", "logprobs": 2}', "logprobs"),
    (b'{"prompt": "x", "logprobs": 0}', "logprobs"),  # the chosen tokens' (0 == false in Python)
    (b'{"prompt": "x", "mirostat": 2}', "mirostat"),  # llama-server's samplers we do not have
    (b'{"prompt": "x", "typical_p": 0.5}', "typical_p"),
    (b'{"prompt": "x", "dry_multiplier": 0.8}', "dry_multiplier"),
    (b'{"prompt": "x", "xtc_probability": 0.5}', "xtc_probability"),
    (b'{"prompt": "x", "top_n_sigma": 1}', "top_n_sigma"),
    (b'{"prompt": "x", "dynatemp_range": 0.5}', "dynatemp_range"),
    (b'{"prompt": "x", "min_keep": 2}', "min_keep"),
    (b'{"prompt": "x", "samplers": ["top_k"]}', "samplers"),
    (b'{"prompt": "x", "n_probs": 3}', "n_probs"),
    (b'{"prompt": "x", "t_max_predict_ms": 100}', "t_max_predict_ms"),
    (b'{"prompt": "x", "chat_template_kwargs": {"enable_thinking": false}}', "chat_template_kwargs"),
    (b'{"prompt": "x", "add_generation_prompt": false}', "add_generation_prompt"),
    (b'{"prompt": "x", "continue_final_message": true}', "continue_final_message"),
    (b'{"prompt": "x", "n_predict": 0}', "n_predict"),
    (b'{"prompt": "x", "n_predict": 65}', "n_predict"),
    (b'{"prompt": "x", "max_tokens": 3, "n_predict": 4}', "n_predict"),
    (b'{"prompt": [[1, 99999999]]}', "prompt"),
    (b'{"prompt": [[1], [2]]}', "prompt"),
    (b'{"prompt": "x", "echo": true}', "echo"),
    (b'{"prompt": "x", "suffix": "end"}', "suffix"),
    (b'{"prompt": "x", "best_of": 3}', "best_of"),
    (b'{"prompt": "x", "grammar": "root ::= \\"a\\""}', "grammar"),
    (b'{"prompt": "x", "response_format": {"type": "xml"}}', "response_format.type"),
    (b'{"prompt": "x", "response_format": {"type": "json_schema"}}', "response_format"),
    (b'{"prompt": "x", "response_format": {"type": "json_object"}, "ignore_eos": true}', "ignore_eos"),
    (
        b'{"prompt": "x", "response_format": {"type": "json_object", "schema": {"type": "objectx"}}}',
        "response_format",
    ),
    (  # no finite document: was a 200 with an empty reply marked "stop"
        b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": '
        b'{"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}}',
        "response_format",
    ),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_requests_get_openai_errors(server, body, param):
    status, out = request(server[0], "POST", "/v1/completions", body)
    assert status == 400, out
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == param
    # a field's value: invalid_value (null for some fields before); a body not a JSON object: invalid_json
    assert out["error"]["code"] == ("invalid_json" if param is None else "invalid_value"), out


def test_chat_refusals(server, client):
    base = server[0]
    status, out = request(base, "POST", "/v1/chat/completions", {"messages": []})
    assert status == 400 and out["error"]["param"] == "messages"
    status, out = request(
        base, "POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}
    )
    assert status == 400 and out["error"]["param"].startswith("messages.0")
    for said in ({"role": "user"}, {"role": "user", "content": None}):  # was read as an empty turn
        status, out = request(base, "POST", "/v1/chat/completions", {"messages": [said]})
        assert status == 400 and out["error"]["param"] == "messages.0.content", out
    long_system = [{"role": "system", "content": "word " * 400}, {"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=long_system, max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    parts = [{"type": "text", "text": "what is this?"}, image]
    status, out = request(
        base, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]}
    )
    assert status == 400 and out["error"]["param"] == "messages.0.content", out
    assert "reads text only, not image_url parts" in out["error"]["message"]
    status, out = request(base, "GET", "/v1/nothing")
    assert status == 404 and out["error"]["type"] == "not_found_error"
    status, out = request(base, "POST", "/v1/completions", b"x" * (9 * 2**20))
    assert status == 413 and "error" in out


def test_long_prompt_is_read_through_shifts(client, tiny):
    _, tok = tiny
    text = " ".join(f"line {i} of a long letter." for i in range(100))  # under 4 x 256 (--max-prompt-tokens)
    n = len(tok(text).input_ids)
    assert n > 256
    out = client.completions.create(model="tiny", prompt=text, max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == n and out.model_extra["selfextend"]["shifts"] >= 1


def test_disconnect_frees_the_slot(server):
    base, engine = server
    conn = connect(base)
    body = {"prompt": "Go on forever", "max_tokens": 64, "stream": True, "temperature": 0, "id_slot": 1}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.readline()  # the first event has arrived: decoding is under way
    conn.sock.close()
    conn.close()
    slot = engine.slots[1]
    deadline = time.monotonic() + 10
    while slot.busy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not slot.busy
    written = len(slot.gen.tokens)
    time.sleep(0.3)
    assert len(slot.gen.tokens) == written  # nothing decoded after it was freed
    assert written < 4 + 64  # stopped before max_tokens


def test_slot_save_restore(server, client, tiny, slots):
    base, engine = server
    messages = [{"role": "user", "content": "Keep this conversation for later."}]
    client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0, extra_body={"id_slot": 1}
    )
    status, saved = request(base, "POST", "/slots/1?action=save", {"filename": "talk.bin"})
    assert status == 200 and saved["n_saved"] > 0
    status, _ = request(base, "POST", "/slots/1?action=erase")
    assert status == 200 and engine.slots[1].gen.tokens == []
    status, restored = request(base, "POST", "/slots/1?action=restore", {"filename": "talk.bin"})
    assert status == 200 and restored["n_restored"] == saved["n_saved"]
    again = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0, extra_body={"id_slot": 1}
    )
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    asked = {"messages": messages, "max_tokens": 2}
    assert request(base, "POST", "/v1/chat/completions", {**asked, "id_slot": -1})[0] == 200  # any: was 400
    assert request(base, "POST", "/v1/chat/completions", {**asked, "id_slot": -2})[0] == 400
    for bad in ({"filename": "../x"}, {"filename": "a/b"}):
        assert request(base, "POST", "/slots/1?action=save", bad)[0] == 400
    assert request(base, "POST", "/slots/1?action=restore", {"filename": "missing.bin"})[0] == 404
    assert request(base, "POST", "/slots/1?action=fly", {"filename": "x"})[0] == 400
    assert request(base, "POST", "/slots/7?action=erase")[0] == 404
    for name in ("e" * 255, "f" * 252):  # a name near the file system's 255 bytes: was a 500 (its ".tmp")
        status, out = request(base, "POST", "/slots/1?action=save", {"filename": name})
        assert status == 200 and out["filename"] == name, out
    assert request(base, "POST", "/slots/1?action=erase", {})[0] == 200  # erase reads no body
    status, out = request(base, "POST", "/slots/1?action=save", b"")
    assert status == 400 and out["error"]["param"] == "filename", out
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # curl -d's: the body is JSON all the same
    status, out = request(base, "POST", "/slots/1?action=restore", {"filename": "talk.bin"}, form)
    assert status == 200 and out["n_restored"] == saved["n_saved"], out
    saved_file = slots / "talk.bin"
    saved_file.chmod(0o600)  # saved over, it stays private (it became 0644)
    assert request(base, "POST", "/slots/1?action=save", {"filename": "talk.bin"})[0] == 200
    assert stat.S_IMODE(saved_file.stat().st_mode) == 0o600
    aside = saved_file.parent.rename(saved_file.parent.with_name("moved"))
    try:  # the folder gone: torch.save's RuntimeError was a 500 "internal error: RuntimeError"
        status, out = request(base, "POST", "/slots/1?action=save", {"filename": "talk.bin"})
        assert status == 500 and out["error"]["message"].endswith("no folder " + str(saved_file.parent)), out
    finally:
        aside.rename(saved_file.parent)


def test_max_completion_tokens_is_max_tokens(server, client):
    """OpenAI's newer name for ``max_tokens`` (the ``openai`` client's ``max_completion_tokens=``) limits the
    reply as ``max_tokens`` does (it was ignored: replies ran to the server's default), within the same
    bound; both given must agree."""
    base, _ = server
    messages = [{"role": "user", "content": "Write a long story about the sea."}]
    reply = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    for body, param in (
        ({"max_completion_tokens": 10**12}, "max_completion_tokens"),
        ({"max_completion_tokens": 3, "max_tokens": 4}, "max_completion_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logit_bias": {"": -100}}, "logit_bias"),
        (
            {"messages": [*messages, {"role": "assistant", "tool_calls": [{"id": "a"}]}]},
            "messages.1.tool_calls",
        ),
    ):
        status, out = request(base, "POST", "/v1/chat/completions", {"messages": messages, **body})
        assert status == 400 and out["error"]["param"] == param, (body, out)
    for said in ({"n_predict": 3}, {"n_predict": 3, "max_tokens": 3}):  # llama-server's name: was ignored
        status, out = request(
            base, "POST", "/v1/chat/completions", {"messages": messages, "ignore_eos": True, **said}
        )
        assert status == 200 and out["usage"]["completion_tokens"] == 3, out


def test_what_openai_and_llama_server_allow_is_taken(server, client, tiny):
    """null for n and stream (OpenAI's "unsaid"), a list of one token list as the prompt, tool_choice
    "auto" without tools, HEAD on the GET routes (uptime checks send it), /props's sampling settings under
    the requests' names, /tokenize's parse_special."""
    base, tok = server[0], tiny[1]
    ids = tok("The sea is").input_ids
    want = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0).choices[0].text
    for extra in ({"n": None, "stream": None}, {"tool_choice": "auto"}):
        status, out = request(
            base, "POST", "/v1/completions", {"prompt": [ids], "max_tokens": 4, "temperature": 0, **extra}
        )
        assert status == 200 and out["choices"][0]["text"] == want, out
    for path in ("/health", "/v1/models", "/props", "/metrics", "/slots"):
        conn = connect(base, 30)
        conn.request("HEAD", path)
        response = conn.getresponse()
        assert response.status == 200 and response.read() == b"", path
        conn.close()
    params = request(base, "GET", "/props")[1]["default_generation_settings"]["params"]
    assert params["repeat_penalty"] == 1.0 and "repetition_penalty" not in params
    text = "<|im_start|>hi"
    parsed = request(base, "POST", "/tokenize", {"content": text})[1]["tokens"]
    plain = request(base, "POST", "/tokenize", {"content": text, "parse_special": False})[1]["tokens"]
    assert (
        parsed[0] == tok.convert_tokens_to_ids("<|im_start|>")
        and plain == tok(text, split_special_tokens=True).input_ids
    )
    assert len(plain) > len(parsed)


def test_api_key(tiny):
    model, tok = tiny
    with serving(model, tok, n_ctx=64, api_key="s3cret") as (base, _):
        assert request(base, "GET", "/health")[0] == 200
        assert request(base, "GET", "/")[0] == 200  # the chat page's files are public; the API is not
        status, out = request(base, "GET", "/v1/models")
        assert status == 401 and out["error"]["type"] == "authentication_error"
        assert request(base, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
        for said in (
            "bearer s3cret",
            "BEARER  s3cret",
            "Bearer s3cret ",
        ):  # the scheme is any case (RFC 7235)
            assert request(base, "GET", "/v1/models", headers={"Authorization": said})[0] == 200, said
        for said in ("s3cret", "Basic s3cret", "Bearers3cret", "Bearer s3cre"):
            assert request(base, "GET", "/v1/models", headers={"Authorization": said})[0] == 401, said
        assert request(base, "GET", "/openapi.json")[0] == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="t", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_sigterm_drains_then_exits_0(tiny_dir):
    """``selfextend serve`` as a process: SIGTERM lets the stream in flight finish, then exits 0."""
    args = ("-m", str(tiny_dir), "--weights", "float", "--ctx", "128", "--max-tokens", "64")
    with serve_process(*args) as (base, proc):
        conn = connect(base)
        body = {"prompt": "Tell a story", "max_tokens": 48, "stream": True, "temperature": 0}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        first = response.readline()
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        events = [e for e in (first.decode() + response.read().decode()).split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][6:])
        assert last["choices"][0]["finish_reason"] in ("length", "stop")
        assert proc.wait(60) == 0
        assert "stopped" in proc.stderr.read()


def test_sigterm_past_the_drain_timeout_cancels_quietly(tiny_dir):
    """A stream still running when the drain time is up ends with an error event and ``[DONE]`` just before
    it (it was cut off mid-stream, uvicorn's CancelledError logged), no traceback, exit 0."""
    args = (
        "-m",
        str(tiny_dir),
        "--weights",
        "float",
        "--ctx",
        "64",
        "--max-tokens",
        "1000000",
        "--drain-timeout",
        "1",
    )
    with serve_process(*args) as (base, proc):
        conn = connect(base)
        body = {
            "prompt": "Tell a story",
            "max_tokens": 1000000,
            "stream": True,
            "temperature": 2.0,
            "seed": 1,
        }
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        first = response.readline()
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)  # twice, as a supervisor and `timeout` do: the second a no-op
        events = [e for e in (first.decode() + response.read().decode()).split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]", events[-3:]
        assert json.loads(events[-2][6:])["error"]["message"].endswith("the server is stopping"), events[-2]
        assert proc.wait(60) == 0
        err = proc.stderr.read()
        assert "stopped" in err and "Traceback" not in err, err
        assert "Exception in thread" not in err and "Event loop is closed" not in err


def test_ignore_eos_writes_to_max_tokens(server, client, tiny):
    """llama.cpp's ``ignore_eos``: the reply goes on past end-of-sequence tokens. The tiny model's greedy
    first token is made its end-of-sequence token here, so without the field the reply stops at once."""
    model, tok = tiny
    prompt = "The harbour at dawn"
    first = int(model(torch.tensor([tok(prompt).input_ids])).logits[0, -1].argmax())
    engine = server[1]
    eos, engine.eos = engine.eos, {first}
    try:
        kwargs = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        stopped = client.completions.create(**kwargs)
        assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 0
        on = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
        assert on.choices[0].finish_reason == "length" and on.usage.completion_tokens == 12
    finally:
        engine.eos = eos


def test_engine_loop_runs_on_the_calling_thread(tiny):
    """``serve`` runs the engine on its main thread (the one that loaded the model): ``run_loop`` serves
    jobs there until ``stop`` is called, here from the job's own last event."""
    from selfextend.generation.sampling import SamplingParams
    from selfextend.server.engine import Engine, Job

    model, tok = tiny
    engine = Engine(model, tok, 64)
    events: list[tuple[str, threading.Thread]] = []

    def emit(event: dict) -> None:
        events.append((event["type"], threading.current_thread()))
        if event["type"] == "done":
            engine.stop()

    ids = tok("The sea is").input_ids
    assert engine.submit(Job(ids, 0, SamplingParams(), 80, emit))  # 80 tokens in 64 cells: a shift
    engine.run_loop()
    assert [kind for kind, _ in events][0] == "start" and events[-1][0] == "done"
    assert {thread for _, thread in events} == {threading.main_thread()}
    assert not engine.thread.is_alive() and engine.slots[0].gen.cache.shifts >= 1


def test_serve_on_a_taken_port_exits_non_zero(tiny_dir):
    """The HTTP server could not listen: the process ends (it does not wait on its engine), not 0."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = subprocess.run(
            [sys.executable, "-m", "selfextend", "serve", "-m", str(tiny_dir), "--port", port],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode != 0 and "address already in use" in out.stderr and "Traceback" not in out.stderr


def test_serve_refuses_bad_flags_in_one_line(tiny_dir):
    wrong_origins = (["--cors", "example.com"], ["--cors", "https://app.example/chat"])
    for args in (["--ctx", "8"], ["--parallel", "0"], ["--port", "70000"], ["-g", "4"], *wrong_origins):
        out = subprocess.run(
            [sys.executable, "-m", "selfextend", "serve", "-m", str(tiny_dir), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0 and out.stderr.startswith("error:") and len(out.stderr.splitlines()) == 1


def test_cache_prompt_false_recomputes(client):
    kwargs = dict(model="tiny", prompt="Recompute me, please, every time", max_tokens=2, temperature=0)
    client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1  # logits needed
    fresh = client.completions.create(**kwargs, extra_body={"cache_prompt": False})
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].text == again.choices[0].text


def greedy_ids(model, ids: list[int], n: int, banned: set[int]) -> list[int]:
    """n greedy steps over fresh forwards, ``banned`` tokens' logits at -inf."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            logits[list(banned)] = float("-inf")
            out.append(int(logits.argmax()))
    return out


def test_logit_bias_bans_tokens(client, tiny):
    """Issue 30 item 6: banned tokens (-100, false, by id or by text as llama-server reads them) never
    appear; the reply is the greedy one with those tokens removed."""
    model, tok = tiny
    ids = tok("The banned words").input_ids
    plain = greedy_ids(model, ids, 8, set())
    text = tok.decode(plain[:2])
    banned = {str(plain[0]): -100, str(plain[1]): False, text: -100}
    out = client.completions.create(
        model="tiny", prompt="The banned words", max_tokens=8, temperature=0, logit_bias=banned
    )
    gone = {plain[0], plain[1], *tok(text, add_special_tokens=False).input_ids}
    assert out.choices[0].text == tok.decode(greedy_ids(model, ids, 8, gone), skip_special_tokens=True)
    sampled = client.completions.create(
        model="tiny", prompt="The banned words", max_tokens=8, temperature=1.5, seed=3, logit_bias=banned
    )
    assert not gone & set(tok(sampled.choices[0].text, add_special_tokens=False).input_ids)


def test_text_too_long_for_the_prompt_limit_is_refused_before_tokenizing(server):
    """A probe's find: 7.8 MB of text took 18 s of tokenizing before its 400. Text longer than the limit's
    tokens could spell (each at most the tokenizer's longest token) is refused unread, prompt or messages;
    text under that bound is still counted in tokens."""
    big = "sea " * 100_000  # 400,000 characters: over 4 x 81 x 1,024
    for path, body in (
        ("/v1/completions", {"prompt": big}),
        ("/v1/completions", {"prompt": [big]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": big}]}]},
        ),
    ):
        status, out = request(server[0], "POST", path, body)
        assert status == 400 and "characters are more than 1024 tokens" in out["error"]["message"], out
        assert out["error"]["code"] == "context_length_exceeded"
    status, out = request(server[0], "POST", "/v1/completions", {"prompt": "sea " * 2000})
    assert status == 400 and re.match(r"the prompt has 20\d\d tokens", out["error"]["message"]), out


def test_a_body_that_is_not_an_object_is_refused_in_json_words(server):
    """A probe's find: pydantic's "valid dictionary or instance of ChatRequest" named our class."""
    for body, kind in ((b"[1, 2]", "an array"), (b'"x"', "a string"), (b"null", "null"), (b"5", "a number")):
        for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
            status, out = request(server[0], "POST", path, body)
            assert (
                status == 400
                and out["error"]["message"] == f"the request body must be a JSON object, not {kind}"
            )


def test_a_bias_banning_every_token_is_refused(server, tiny):
    """A probe's find: banning all ids gave a 200 of id 0 (a banned token) at temperature 0 and a 500
    blaming the model when sampled; now a 400 either way. Leaving one id makes the reply that id."""
    tok = tiny[1]
    for temperature in (0, 1):
        body = {"prompt": "x", "max_tokens": 3, "temperature": temperature}
        body["logit_bias"] = [[i, False] for i in range(len(tok))]
        status, out = request(server[0], "POST", "/v1/completions", body)
        assert status == 400 and "bans every one of the" in out["error"]["message"], out
        body["logit_bias"] = [[i, False] for i in range(len(tok)) if i != 42]
        body["ignore_eos"] = True
        status, out = request(server[0], "POST", "/v1/completions", body)
        assert status == 200 and out["choices"][0]["text"] == tok.decode([42] * 3), out


def test_json_schema_reply_parses_and_validates(client):
    """Issue 30 item 6: response_format json_schema holds even a random model's reply to the schema;
    json_object to some JSON object."""
    import jsonschema
    from test_generate import SCHEMA

    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "A colour, a count and a flag, as JSON."}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=64, temperature=0, response_format=fmt
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert out.choices[0].finish_reason == "stop"  # this reply ends within max_tokens: it must parse
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_three_turn_conversation_continued_equals_fresh(server, client, tiny):
    """Item 9: a greedy three-turn conversation where each turn continues slot 0's cache (the decode step
    wrote the earlier replies' cells) gives the tokens the same prompts give computed whole from scratch on
    slot 1 (``cache_prompt`` false: every token prefilled), and the last logits agree to float rounding."""
    _, engine = server
    model, tok = tiny
    questions = ["Name a colour of the sea.", "And of the sky at dusk?", "Which of them is darker?"]
    ids = chat_ids(
        tok, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": questions[0]}]
    )
    kwargs = dict(model="tiny", max_tokens=12, temperature=0)
    for i, question in enumerate(questions):
        if i:
            held = list(engine.slots[0].gen.tokens)  # the prompt and the reply but its last token
            ids = held + tok(f"\nUser: {question}\nAssistant:", add_special_tokens=False).input_ids
        continued = client.completions.create(
            prompt=ids, **kwargs, extra_body={"id_slot": 0, "ignore_eos": True}
        )
        fresh = client.completions.create(
            prompt=ids, **kwargs, extra_body={"id_slot": 1, "ignore_eos": True, "cache_prompt": False}
        )
        a, b = engine.slots[0].gen, engine.slots[1].gen
        assert continued.choices[0].text == fresh.choices[0].text and a.tokens == b.tokens, i
        torch.testing.assert_close(a.last_logits, b.last_logits, atol=1e-4, rtol=1e-4)
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        if i:
            assert continued.usage.prompt_tokens_details.cached_tokens == len(held)
