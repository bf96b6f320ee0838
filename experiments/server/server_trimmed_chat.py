"""A scripted 30-turn chat against ``selfextend serve --ctx 1024``, with a history the client trims from the
front (as chat front ends do when the conversation outgrows a token budget), once with cache reuse on
(common prefix + chunks moved by K-shift) and once off (every prompt computed whole: ``cache_prompt: false``).

The chat is ``selfextend bench``'s (:mod:`selfextend.bench.trimmed_chat`; ``selfextend bench --cases server``
runs it against llama-server's ``--cache-reuse`` too). Per turn: prompt tokens, prompt tokens computed
(prompt - cached), tokens moved, time to first token measured by the client, reply tokens. Writes
experiments/server/results/server_trimmed_chat.jsonl and prints a summary.

    python experiments/server/server_trimmed_chat.py   # ~10 minutes on a 2-core CPU
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from selfextend.bench.servers import free_port, start, stop
from selfextend.bench.trimmed_chat import conversation, trimmed_median
from selfextend.models import ensure_converted, resolve_model

OUT = Path(__file__).parent / "results" / "server_trimmed_chat.jsonl"
CTX = 1024


def main() -> None:
    tok = AutoTokenizer.from_pretrained(ensure_converted(resolve_model("smollm2-135m")))
    port = free_port()
    cmd = [sys.executable, "-m", "selfextend", "serve", "--port", str(port), "--ctx", str(CTX)]
    base = f"http://127.0.0.1:{port}"
    proc = start(cmd, base, Path(tempfile.gettempdir()) / "server_trimmed_chat.log", None)
    try:
        rows = [{"mode": "reuse", **r} for r in conversation(base, tok, True)]
        rows += [{"mode": "recompute", **r} for r in conversation(base, tok, False)]
    finally:
        stop(proc)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for mode in ("reuse", "recompute"):
        rs = [r for r in rows if r["mode"] == mode]
        first_trim, trimmed_ttft = trimmed_median(rs)
        trimmed = [r for r in rs if r["turn"] >= first_trim]
        print(
            f"{mode}: computed prompt tokens {sum(r['computed_tokens'] for r in rs)} of "
            f"{sum(r['prompt_tokens'] for r in rs)}; median TTFT "
            f"{statistics.median(r['ttft_s'] for r in rs):.2f} s, from turn {first_trim} (trimming) on "
            f"{trimmed_ttft:.2f} s; median computed per turn from then "
            f"{statistics.median(r['computed_tokens'] for r in trimmed)}"
        )


if __name__ == "__main__":
    main()
