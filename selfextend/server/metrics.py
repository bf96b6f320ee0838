"""The server's counters, and their Prometheus text form for ``/metrics``.

The names follow llama-server's (``llamacpp:prompt_tokens_total``, ...), so dashboards and scrapers written
for it read ours; ours add the cache-reuse counters, which llama-server does not publish.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Metrics:
    """Totals since the server started, updated by the engine's thread as each request ends."""

    requests: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (reused ones excluded), as llama-server counts them
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    reused_tokens: int = 0  # prompt tokens taken from a slot's cache (common prefix or moved by K-shift)
    reuse_hits: int = 0  # requests that reused at least one cached prompt token
    cancelled: int = 0  # requests whose client left before the end (queued or running)
    failed: int = 0  # requests ended by an error (the model's output not numbers, a failed step)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, done: dict[str, Any]) -> None:
        """Count one finished request from its ``done`` event."""
        with self.lock:
            self.requests += 1
            self.prompt_tokens += done["prompt_tokens"] - done["cached_tokens"]
            self.prompt_seconds += done["ttft_s"]
            self.predicted_tokens += done["completion_tokens"]
            if done["tokens_per_second"] > 0:
                self.predicted_seconds += max(done["completion_tokens"] - 1, 0) / done["tokens_per_second"]
            self.reused_tokens += done["cached_tokens"]
            self.reuse_hits += done["cached_tokens"] > 0

    def count(self, kind: str) -> None:
        """Count one request that ended without a reply: ``cancelled`` or ``failed``."""
        with self.lock:
            setattr(self, kind, getattr(self, kind) + 1)

    def prometheus(
        self, slots: list[dict[str, Any]], queued: int, stored: tuple[int, int, int] = (0, 0, 0)
    ) -> str:
        """The counters and the slots' live state in Prometheus' text exposition format; ``stored``: the
        prompt store's hits, tokens they held and bytes held now."""
        with self.lock:
            totals = (
                ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", self.prompt_tokens),
                ("prompt_seconds_total", "counter", "Prompt process time", self.prompt_seconds),
                (
                    "tokens_predicted_total",
                    "counter",
                    "Number of generation tokens processed.",
                    self.predicted_tokens,
                ),
                ("tokens_predicted_seconds_total", "counter", "Predict process time", self.predicted_seconds),
                ("requests_total", "counter", "Number of requests finished.", self.requests),
                ("requests_cancelled_total", "counter", "Requests whose client left first.", self.cancelled),
                ("requests_failed_total", "counter", "Requests ended by an error.", self.failed),
                (
                    "prompt_tokens_reused_total",
                    "counter",
                    "Prompt tokens taken from a slot's cache instead of computed.",
                    self.reused_tokens,
                ),
                (
                    "cache_reuse_hits_total",
                    "counter",
                    "Requests that reused cached prompt tokens.",
                    self.reuse_hits,
                ),
                (
                    "prompt_tokens_seconds",
                    "gauge",
                    "Average prompt throughput in tokens/s.",
                    _rate(self.prompt_tokens, self.prompt_seconds),
                ),
                (
                    "predicted_tokens_seconds",
                    "gauge",
                    "Average generation throughput in tokens/s.",
                    _rate(self.predicted_tokens, self.predicted_seconds),
                ),
            )
        cells = sum(s["n_past"] for s in slots)
        capacity = sum(s["n_ctx"] for s in slots)
        busy = sum(bool(s["is_processing"]) for s in slots)
        live = (
            (
                "kv_cache_usage_ratio",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
                cells / capacity if capacity else 0.0,
            ),
            ("kv_cache_tokens", "gauge", "KV-cache tokens.", cells),
            ("requests_processing", "gauge", "Number of requests processing.", busy),
            ("requests_deferred", "gauge", "Number of requests deferred.", queued),
            ("slots_total", "gauge", "Number of slots.", len(slots)),
            ("prompt_store_hits_total", "counter", "Prompts given a conversation kept in memory.", stored[0]),
            ("prompt_store_tokens_total", "counter", "Prompt tokens those conversations held.", stored[1]),
            ("prompt_store_bytes", "gauge", "Bytes of cells kept in memory (--cache-ram).", stored[2]),
        )
        lines = []
        for name, kind, text, value in (*totals, *live):
            lines += [
                f"# HELP llamacpp:{name} {text}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {_number(value)}",
            ]
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """A sample's value in full: an integer's every digit, a float's shortest exact form (``:g`` rounds
    to six digits: 1234567 would read 1.23457e+06)."""
    return str(value) if isinstance(value, int) else repr(float(value))


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0
