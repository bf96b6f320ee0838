"""``selfextend serve`` on the real default model (SmolLM2-135M-Instruct, int8): an answer a person would
accept, reuse in a front-trimmed conversation, and the README's curl and ``openai`` examples run as
written (on a free port instead of 8080)."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from server_util import serve_process

README = Path(__file__).resolve().parents[1] / "README.md"
pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def server():
    with serve_process("--ctx", "1024", "--parallel", "2", "--cache-reuse", "16") as (base, proc):
        yield base


def section_blocks(kind: str) -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Server") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(rf"```{kind}\n(.*?)```", section, re.S)


def test_answers_and_reuses(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)
    # the README's example. Asked the bare question this 4-bit model starts in French, as its own forward
    # and llama.cpp on the same file do ("Al" 25.47 against "The" 25.46 first); the decode step's bfloat16
    # logits tied the two at 25.5, and the lower id, "The", answered "Paris" by luck
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
    ]
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
    assert "Paris" in out.choices[0].message.content
    history = [{"role": "system", "content": "You are a helpful assistant."}]
    for q in ("Name a fruit.", "Name a colour.", "Name an animal.", "Name a city."):
        history.append({"role": "user", "content": q})
        r = client.chat.completions.create(model="m", messages=history, max_tokens=16, temperature=0)
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    trimmed = [
        history[0],
        *history[3:],
        {"role": "user", "content": "Name a river."},
    ]  # the oldest exchange cut
    r = client.chat.completions.create(model="m", messages=trimmed, max_tokens=16, temperature=0)
    assert r.model_extra["selfextend"]["moved_tokens"] > 20
    assert r.usage.prompt_tokens_details.cached_tokens > r.usage.prompt_tokens // 2


def test_readme_examples_run(server, tmp_path):
    port = server.rsplit(":", 1)[1]
    shells = [b for b in section_blocks("bash") if "curl" in b]
    assert shells, "no curl example in the README's Server section"
    for block in shells:
        script = block.replace("8080", port)
        r = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0 and '"error"' not in r.stdout, (script, r.stdout, r.stderr)
        assert "content" in r.stdout or "text" in r.stdout
    pythons = section_blocks("python")
    assert pythons
    for block in pythons:
        example = tmp_path / "example.py"
        example.write_text(block.replace("8080", port), encoding="utf-8")
        r = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]


def test_greedy_reply_does_not_depend_on_the_cache():
    """Issue 30 item 7: "hi" at temperature 0 gets the same tokens computed fresh, with its prompt cached,
    in a batch of 3 concurrent requests (each slot's own decode step: fewer rows than the shared forward's
    threshold) and in another slot that held a different conversation."""
    with serve_process("--ctx", "1024", "--parallel", "4") as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)

        def ask(text: str = "hi", **extra) -> tuple[str, int, int]:
            messages = [{"role": "user", "content": text}]
            r = client.chat.completions.create(
                model="m", messages=messages, max_tokens=8, temperature=0, extra_body=extra
            )
            cached = r.usage.prompt_tokens_details.cached_tokens
            return r.choices[0].message.content, cached, r.model_extra["selfextend"]["slot"]

        fresh, fresh_cached, slot = ask()
        cached, reused, same_slot = ask()
        assert fresh_cached == 0 and reused > 20 and same_slot == slot
        with ThreadPoolExecutor(3) as pool:
            batch = list(pool.map(lambda _: ask(), range(3)))
        assert len({s for _, _, s in batch}) == 3  # three slots at once
        other = next(i for i in range(4) if i != slot)
        ask("Tell me about owls.", id_slot=other)
        moved, partly, other_slot = ask(id_slot=other)
        assert other_slot == other and 0 < partly < reused
    assert len(fresh.split()) > 2
    assert [cached, *(t for t, _, _ in batch), moved] == [fresh] * 5


def test_banned_token_never_appears_and_json_schema_holds(server):
    """Issue 30 item 6 on the real model: logit_bias -100 on the token the greedy reply to "hi" starts with
    (and on every token of that reply) keeps them all out; a json_schema reply parses and validates."""
    import json

    import jsonschema
    from transformers import AutoTokenizer

    from selfextend.models import ensure_converted, resolve_model

    tok = AutoTokenizer.from_pretrained(ensure_converted(resolve_model("smollm2-135m")))
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
    ids = tok(plain.choices[0].message.content, add_special_tokens=False).input_ids
    for banned in ({ids[0]}, set(ids)):
        out = client.chat.completions.create(
            model="m", messages=messages, max_tokens=8, temperature=0, logit_bias=dict.fromkeys(banned, -100)
        )
        text = out.choices[0].message.content
        assert text and not banned & set(tok(text, add_special_tokens=False).input_ids), (banned, text)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    ask = [{"role": "user", "content": "Name a famous city and its country, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    out = client.chat.completions.create(
        model="m", messages=ask, max_tokens=64, temperature=0, response_format=fmt
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
