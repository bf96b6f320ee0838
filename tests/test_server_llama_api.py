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
    assert request(base, "POST", "/tokenize", {"content": ""})[1] == {"tokens": []}
    status, back = request(base, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"content": text}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/tokenize", {"content": 5}, "content"),
        ("/tokenize", {}, "content"),
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
    """``selfextend serve`` gives its slots the cells ``generate`` uses by default (bf16 where the native
    decode step runs the model) and answers over them; ``--cache-type`` chooses another."""
    from server_util import serve_process

    from selfextend.generation.generator import default_cache_dtype

    model = LlamaForCausalLM.from_pretrained(tiny_dir)
    want = {torch.bfloat16: "bf16", None: "f32"}[default_cache_dtype(model)]
    with serve_process("-m", str(tiny_dir), "--ctx", "64", "-np", "2") as (base, _):
        body = {"prompt": "The sea", "max_tokens": 4, "temperature": 0}
        assert request(base, "POST", "/v1/completions", body)[0] == 200
        slots = request(base, "GET", "/slots")[1]
        assert [s["cache_type"] for s in slots] == [want, want]
    engine = Engine(model, AutoTokenizer.from_pretrained(tiny_dir), 64, cache_dtype=torch.float16)
    assert engine.info()[0]["cache_type"] == "f16"
