"""llama-server's own endpoints through a real loopback socket: /tokenize, /detokenize, /apply-template,
/props and /metrics (Prometheus text), on a tiny random model with the default model's tokenizer."""

from __future__ import annotations

import re

import pytest
import torch
from server_util import request, serving
from transformers import AutoTokenizer, LlamaForCausalLM

from selfextend.server.engine import Engine
from selfextend.server.prompts import chat_prompt
from selfextend.server.schemas import Message

SAMPLE = re.compile(r"^(?P<name>llamacpp:[a-z_]+) (?P<value>[-+0-9.e]+|nan|inf)$")


@pytest.fixture(scope="module")
def server(tiny_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    model.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    with serving(model, tok, n_ctx=128, parallel=2, max_tokens=32) as (base, engine):
        yield base, engine, tok


def metrics(base: str) -> dict[str, float]:
    status, text = request(base, "GET", "/metrics")
    assert status == 200
    values, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("counter", "gauge")
            typed.add(name)
        elif not line.startswith("# HELP "):
            m = SAMPLE.match(line)
            assert m, f"not a Prometheus sample line: {line!r}"
            values[m["name"]] = float(m["value"])
    assert set(values) == typed
    return values


def test_tokenize_and_detokenize_round_trip(server):
    base, _, tok = server
    text = "Hello world, the sea is calm."
    status, body = request(base, "POST", "/tokenize", {"content": text})
    assert status == 200 and body["tokens"] == tok(text, add_special_tokens=False).input_ids
    status, pieces = request(base, "POST", "/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == body["tokens"]
    assert "".join(p["piece"] for p in pieces["tokens"]) == text
    wide = "café 🌊 日本"  # the wave and 日 in tokens that each hold part of a character
    status, pieces = request(base, "POST", "/tokenize", {"content": wide, "with_pieces": True})
    raw = [p.encode() if isinstance(p, str) else bytes(p) for p in (t["piece"] for t in pieces["tokens"])]
    assert status == 200 and b"".join(raw) == wide.encode()  # "\ufffd" pieces, as llama-server's bytes
    assert any(isinstance(p["piece"], list) for p in pieces["tokens"])
    assert request(base, "POST", "/tokenize", {"content": ""})[1] == {"tokens": []}
    status, back = request(base, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"content": text}


def test_bodies_are_json_whatever_the_content_type(server):
    """``curl -d`` sends a form's content type; llama-server reads the body as JSON all the same (these
    endpoints refused it: "Input should be a valid dictionary"), as the completion endpoints do here."""
    base, _, tok = server
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, body = request(base, "POST", "/tokenize", {"content": "Hello world"}, form)
    assert status == 200 and body["tokens"] == tok("Hello world", add_special_tokens=False).input_ids
    assert request(base, "POST", "/detokenize", {"tokens": body["tokens"]}, form)[1] == {
        "content": "Hello world"
    }
    messages = [{"role": "user", "content": "hi"}]
    assert request(base, "POST", "/apply-template", {"messages": messages}, form)[0] == 200
    status, out = request(base, "POST", "/tokenize", b"{not json", form)
    assert status == 400 and out["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/tokenize", {"content": 5}, "content"),
        ("/tokenize", {}, "content"),
        ("/tokenize", {"content": "a\x00b"}, "content"),
        ("/apply-template", {"messages": []}, "messages"),
    ],
)
def test_bad_bodies_are_openai_400s(server, path, body, param):
    status, answer = request(server[0], "POST", path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"


def test_apply_template_is_what_the_chat_endpoint_reads(server):
    base, _, tok = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    status, body = request(base, "POST", "/apply-template", {"messages": messages})
    assert status == 200
    ids = chat_prompt(tok, [Message(**m) for m in messages], None).ids
    assert tok(body["prompt"], add_special_tokens=False).input_ids == ids
    assert body["prompt"].rstrip().endswith("assistant")  # the generation prompt is in it
    status, bare = request(
        base, "POST", "/apply-template", {"messages": messages, "add_generation_prompt": False}
    )
    assert status == 200 and body["prompt"].startswith(bare["prompt"]) and "assistant" not in bare["prompt"]


def test_props(server):
    base, engine, _ = server
    status, body = request(base, "GET", "/props")
    assert status == 200
    assert body["total_slots"] == 2 and body["default_generation_settings"]["n_ctx"] == 128
    assert body["default_generation_settings"]["params"]["temperature"] == 0.0
    assert "{%" in body["chat_template"]


def test_metrics_count_requests_tokens_and_reuse(server):
    base = server[0]
    before = metrics(base)
    assert before["llamacpp:slots_total"] == 2 and before["llamacpp:requests_processing"] == 0
    prompt = "Once upon a time there was a ship that sailed the sea"
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "id_slot": 0}
    status, first = request(base, "POST", "/v1/completions", body)
    assert status == 200
    status, second = request(base, "POST", "/v1/completions", body)
    assert status == 200
    after = metrics(base)
    n = first["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == n - 1  # the same prompt again: all but the last token from the cache
    assert after["llamacpp:requests_total"] - before["llamacpp:requests_total"] == 2
    assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == n + (n - cached)
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 10
    assert (
        after["llamacpp:prompt_tokens_reused_total"] - before["llamacpp:prompt_tokens_reused_total"] == cached
    )
    assert after["llamacpp:cache_reuse_hits_total"] - before["llamacpp:cache_reuse_hits_total"] == 1
    assert after["llamacpp:kv_cache_tokens"] > 0 and 0 < after["llamacpp:kv_cache_usage_ratio"] <= 1
    assert after["llamacpp:predicted_tokens_seconds"] > 0


def test_serve_cells_default_to_generates_type(tiny_dir):
    """``selfextend serve`` gives its slots the cells ``generate`` uses by default, by the documented rule
    (a float32 model on the CPU that the direct decode step runs with its native kernels: bf16; else the
    model's f32), and answers over them; ``--cache-type`` chooses another."""
    from server_util import serve_process

    from selfextend.generation.decode import decode_step_for

    model = LlamaForCausalLM.from_pretrained(tiny_dir)
    step = decode_step_for(model)  # the tiny Llama is float32 on the CPU: the native kernels decide
    want = "bf16" if step is not None and step.native is not None else "f32"
    with serve_process("-m", str(tiny_dir), "--ctx", "64", "-np", "2") as (base, _):
        body = {"prompt": "The sea", "max_tokens": 4, "temperature": 0}
        assert request(base, "POST", "/v1/completions", body)[0] == 200
        slots = request(base, "GET", "/slots")[1]
        assert [s["cache_type"] for s in slots] == [want, want]
    engine = Engine(model, AutoTokenizer.from_pretrained(tiny_dir), 64, cache_dtype=torch.float16)
    assert engine.info()[0]["cache_type"] == "f16"


def test_metrics_print_counters_in_full(server):
    """Item 4: counters past a million are exact integers and seconds every digit of the float (``:g``
    printed 1234567 as 1.23457e+06)."""
    from selfextend.server.metrics import Metrics

    base, engine, _ = server
    big = Metrics(
        requests=3, prompt_tokens=1_234_567, prompt_seconds=1234.5678901, predicted_tokens=98_765_432
    )
    real, engine.metrics = engine.metrics, big
    try:
        status, text = request(base, "GET", "/metrics")
    finally:
        engine.metrics = real
    assert status == 200
    lines = dict(line.split(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert lines["llamacpp:prompt_tokens_total"] == "1234567"
    assert lines["llamacpp:tokens_predicted_total"] == "98765432"
    assert lines["llamacpp:requests_total"] == "3"
    assert float(lines["llamacpp:prompt_seconds_total"]) == big.prompt_seconds
    assert float(lines["llamacpp:prompt_tokens_seconds"]) == big.prompt_tokens / big.prompt_seconds
