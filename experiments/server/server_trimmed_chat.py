"""A scripted 30-turn chat through the ``openai`` client against ``selfextend serve --ctx 1024``, with a
history the client trims from the front (as chat front ends do when the conversation outgrows a token
budget), once with cache reuse on (common prefix + chunks moved by K-shift) and once off (every prompt
computed whole: ``cache_prompt: false``).

Per turn: prompt tokens, prompt tokens computed (prompt - cached), tokens moved, time to first token
measured by the client, reply tokens. Writes experiments/server/results/server_trimmed_chat.jsonl and prints a
summary. llama.cpp's own ``--cache-reuse`` lives in its C++ ``llama-server``; llama-cpp-python's server
(the llama.cpp build this project can install) has a prefix cache but no chunk reuse, so there is no
llama-server figure here.

    python experiments/server/server_trimmed_chat.py   # ~10 minutes on a 2-core CPU
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from server_util import free_port, wait_healthy  # noqa: E402

from selfextend.models import ensure_converted, resolve_model  # noqa: E402

OUT = Path(__file__).parent / "results" / "server_trimmed_chat.jsonl"
CTX, BUDGET, MAX_TOKENS = 1024, 700, 48
SYSTEM = "You are a patient museum guide. Answer in two or three sentences."
TOPICS = [
    "the oldest painting in the museum",
    "the Egyptian mummies",
    "the dinosaur skeleton",
    "the Roman coins",
    "the Viking ship",
    "the medieval armour",
    "the Greek vases",
    "the Chinese porcelain",
    "the Aztec calendar",
    "the impressionist paintings",
    "the sculpture garden",
    "the meteorite",
    "the Renaissance portraits",
    "the map collection",
    "the musical instruments",
    "the clocks",
    "the Japanese swords",
    "the fossils",
    "the tapestries",
    "the jewellery",
    "the steam engine",
    "the Persian carpets",
    "the stained glass",
    "the Inuit carvings",
    "the Mayan jade",
    "the telescope",
    "the samurai armour",
    "the ship models",
    "the glass flowers",
    "the museum's founder",
]


def rendered_tokens(tok, messages) -> int:
    return len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def conversation(
    base: str, tok, reuse: bool, label: str, turns: int = len(TOPICS), reply: str | None = None
) -> list[dict]:
    """The first ``turns`` turns of the scripted chat against the server at ``base``, one row per turn.
    ``reply``: the text each answer enters the history as (None: the answer itself); a fixed one gives two
    servers the same prompts where the model's answers re-tokenize to different lengths (synthetic
    weights)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    history: list[dict] = []
    rows = []
    for turn, topic in enumerate(TOPICS[:turns]):
        history.append({"role": "user", "content": f"Tell me about {topic}."})
        dropped = 0
        while rendered_tokens(tok, [{"role": "system", "content": SYSTEM}, *history]) > BUDGET:
            del history[:2]  # the oldest exchange
            dropped += 1
        messages = [{"role": "system", "content": SYSTEM}, *history]
        t0 = time.perf_counter()
        ttft, text, last = None, "", None
        stream = client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"cache_prompt": reuse},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.choices and chunk.choices[0].finish_reason:
                last = (chunk.model_extra or {}).get("selfextend") or {}  # ours only: llama-server has none
            if chunk.usage:
                usage = chunk.usage
        history.append({"role": "assistant", "content": text if reply is None else reply})
        cached = getattr(usage.prompt_tokens_details, "cached_tokens", None)
        row = {
            "mode": label,
            "turn": turn + 1,
            "dropped_exchanges": dropped,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": cached,
            "computed_tokens": None if cached is None else usage.prompt_tokens - cached,
            "moved_tokens": last.get("moved_tokens"),
            "ttft_s": round(ttft or time.perf_counter() - t0, 3),
            "reply_tokens": usage.completion_tokens,
            "tokens_per_second": round(last["tokens_per_second"], 2) if last else None,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    tok = AutoTokenizer.from_pretrained(ensure_converted(resolve_model("smollm2-135m")))
    port = free_port()
    cmd = [sys.executable, "-m", "selfextend", "serve", "--port", str(port), "--ctx", str(CTX)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 600, proc)
        rows = conversation(base, tok, True, "reuse") + conversation(base, tok, False, "recompute")
    finally:
        proc.terminate()
        proc.wait(120)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for mode in ("reuse", "recompute"):
        rs = [r for r in rows if r["mode"] == mode]
        first_trim = next((r["turn"] for r in rs if r["dropped_exchanges"]), len(rs))
        trimmed = [r for r in rs if r["turn"] >= first_trim]
        print(
            f"{mode}: computed prompt tokens {sum(r['computed_tokens'] for r in rs)} of "
            f"{sum(r['prompt_tokens'] for r in rs)}; median TTFT "
            f"{statistics.median(r['ttft_s'] for r in rs):.2f} s, from turn {first_trim} (trimming) on "
            f"{statistics.median(r['ttft_s'] for r in trimmed):.2f} s; median computed per turn from then "
            f"{statistics.median(r['computed_tokens'] for r in trimmed)}"
        )


if __name__ == "__main__":
    main()
