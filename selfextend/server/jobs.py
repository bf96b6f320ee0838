"""What the engine works on: a request as a :class:`Job`, and a job on its slot as :class:`Running`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from selfextend.generation.generator import GenerationStats
from selfextend.generation.grammar import Grammar
from selfextend.generation.sampling import SamplingParams
from selfextend.generation.text import StopMatcher, TextStream
from selfextend.server.slots import Reuse, Slot


class Stopped(RuntimeError):
    """The engine's loop has ended: it takes no more work."""


@dataclass
class Job:
    """One request: the prompt's tokens and how to generate; events go to ``emit``."""

    prompt: list[int]
    n_keep: int
    sampling: SamplingParams
    max_tokens: int
    emit: Callable[[dict[str, Any]], None]
    seed: int | None = None
    stops: tuple[str, ...] = ()
    slot_id: int | None = None
    cache_prompt: bool = True  # False: recompute the whole prompt
    ignore_eos: bool = False  # True: an end-of-sequence token is text like any other, up to max_tokens
    grammar: Grammar | None = None  # the response format (JSON schema) the reply follows
    draft_max: int | None = None  # drafts checked per pass at most (None: the server's; 0: none)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Running:
    """A job on its slot: how much of its prompt is written, its first token's iterator once it is, text
    state and counts."""

    job: Job
    slot: Slot
    reuse: Reuse
    written: int  # prompt tokens in the slot's cache; the prompt is read in chunks up to its length
    tokens: Iterator[tuple[int, GenerationStats]] | None
    stream: TextStream
    stops: StopMatcher
    shifts_before: int
    started: float
    drafts_before: tuple[int, int] = (0, 0)  # the slot's drafted and kept counts when the job started
    generated: list[int] = field(default_factory=list)
    first_token: float | None = None
    stats: GenerationStats | None = None

    def report(self, reason: str, ended_by_eos: bool) -> dict[str, Any]:
        """What the job's ``done`` event says: why it ended, token counts, reuse, shifts, drafts, times."""
        now = time.perf_counter()
        gen, prompt = self.slot.gen, self.job.prompt
        decode_s = now - self.first_token if self.first_token else 0.0
        return {
            "finish_reason": reason,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(self.generated) - ended_by_eos,
            "cached_tokens": min(self.reuse.tokens, len(prompt) - 1),  # the last one is always run
            "moved_tokens": self.reuse.moved,
            "shifts": gen.cache.shifts - self.shifts_before,
            "draft_n": gen.drafted - self.drafts_before[0],  # llama-server's names: drafts checked
            "draft_n_accepted": gen.kept - self.drafts_before[1],  # and kept
            "ttft_s": (self.first_token or now) - self.started,
            "tokens_per_second": (len(self.generated) - 1) / decode_s if decode_s > 0 else 0.0,
            "slot": self.slot.id,
        }


class Reply:
    """A job's events gathered for a caller that waits for the whole reply (tests, experiments): pass
    :meth:`emit` as the job's ``emit``, then :meth:`wait`."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.done = threading.Event()

    def emit(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if event["type"] in ("done", "error"):
            self.done.set()

    def wait(self, timeout: float) -> tuple[str, dict[str, Any]]:
        """(the reply's text, its last event: ``done`` or ``error``); TimeoutError past ``timeout`` s."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"no reply in {timeout} s")
        return "".join(e["text"] for e in self.events if e["type"] == "text"), self.events[-1]
