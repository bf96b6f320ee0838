"""A scripted chat whose history the client trims from the front, as chat front ends do when a conversation
outgrows a token budget: the case where a server's cache reuse (chunks moved by K-shift, llama-server's
``--cache-reuse``) saves recomputing the prompt. One row per turn: prompt tokens, how many were computed,
time to first token as the client sees it."""

from __future__ import annotations

import statistics

from selfextend.bench.clients import stream_chat

BUDGET, MAX_TOKENS = 700, 48  # rendered prompt tokens the client keeps; reply tokens per turn
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


def rendered_tokens(tokenizer, messages: list[dict]) -> int:
    """Tokens of ``messages`` rendered by the chat template, with the assistant's turn opened."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids if isinstance(ids, list) else ids["input_ids"])  # a list, or a BatchEncoding


def conversation(
    base: str,
    tokenizer,
    reuse: bool = True,
    turns: int = len(TOPICS),
    reply: str | None = None,
    budget: int = BUDGET,
) -> list[dict]:
    """The first ``turns`` turns of the scripted chat against the server at ``base``, greedy, one row per
    turn. Before each request the oldest exchanges are dropped while the rendered conversation is over
    ``budget`` tokens. ``reuse``: the request's ``cache_prompt`` (False: every prompt computed whole).
    ``reply``: the text each answer enters the history as (None: the answer itself); a fixed one gives two
    servers the same prompts where synthetic weights write answers of different token lengths."""
    history: list[dict] = []
    rows = []
    for turn, topic in enumerate(TOPICS[:turns]):
        history.append({"role": "user", "content": f"Tell me about {topic}."})
        dropped = 0
        while rendered_tokens(tokenizer, [{"role": "system", "content": SYSTEM}, *history]) > budget:
            del history[:2]  # the oldest exchange
            dropped += 1
        messages = [{"role": "system", "content": SYSTEM}, *history]
        r = stream_chat(base, messages, MAX_TOKENS, temperature=0, extra={"cache_prompt": reuse})
        if r["status"] != 200:
            raise RuntimeError(f"{base} answered turn {turn + 1} with {r['status']}: {r['error']}")
        history.append({"role": "assistant", "content": r["text"] if reply is None else reply})
        ours = r["last"].get("selfextend") or {}  # llama-server has no such block
        rows.append(
            {
                "turn": turn + 1,
                "dropped_exchanges": dropped,
                "prompt_tokens": r["prompt"],
                "cached_tokens": r["cached"],
                "computed_tokens": r["prompt"] - r["cached"],
                "moved_tokens": ours.get("moved_tokens"),
                "ttft_s": round(r["ttft"] or r["seconds"], 3),
                "reply_tokens": r["tokens"],
            }
        )
    return rows


def trimmed_median(rows: list[dict]) -> tuple[int, float]:
    """The first turn whose history was trimmed (the last turn if none was), and the median TTFT from that
    turn on (seconds)."""
    first = next((r["turn"] for r in rows if r["dropped_exchanges"]), rows[-1]["turn"])
    return first, statistics.median(r["ttft_s"] for r in rows if r["turn"] >= first)
