"""Chunked prefill in the server's engine: a long prompt that arrives while another request streams is
read a chunk per step between that stream's tokens (llama-server's batches), and its reply is the one a
whole-prompt prefill gives."""

from __future__ import annotations

import threading

import torch

from selfextend.generation.generator import Generator
from selfextend.generation.sampling import SamplingParams
from selfextend.server.engine import Engine, Job

CHUNK = 16


class Recorder:
    """Every token a slot's cache took, in order: (generator, tokens written), from :meth:`Generator.written`
    (which prefill pieces, lone tokens and the batched step's rows all end in)."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def wrap(self, monkeypatch) -> None:
        written = Generator.written

        def recorded(gen: Generator, ids: list[int], logits: torch.Tensor) -> None:
            with self.lock:
                self.writes.append((id(gen), len(ids)))
            written(gen, ids, logits)

        monkeypatch.setattr(Generator, "written", recorded)


def job(ids: list[int], n: int, events: list, started: threading.Event | None = None) -> Job:
    def emit(event: dict) -> None:
        events.append(event)
        if started is not None and event["type"] == "text":
            started.set()

    return Job(ids, 0, SamplingParams(), n, emit, ignore_eos=True)


def reply(events: list) -> str:
    assert events[-1]["type"] == "done", events
    return "".join(e["text"] for e in events if e["type"] == "text")


def wait_done(events: list, timeout: float = 300) -> None:
    deadline = threading.Event()
    for _ in range(int(timeout * 20)):
        if events and events[-1]["type"] in ("done", "error"):
            return
        deadline.wait(0.05)
    raise TimeoutError(events)


def test_a_long_prompt_delays_a_running_stream_by_at_most_one_chunk(tiny, monkeypatch):
    model, tok = tiny
    text = " ".join(f"word{i}" for i in range(60))
    long_ids = tok(text).input_ids
    assert len(long_ids) > 6 * CHUNK

    alone: list = []
    engine = Engine(model, tok, 256, parallel=2, prefill_chunk=512)
    engine.start()
    try:
        engine.submit(job(long_ids, 6, alone))
        wait_done(alone)
    finally:
        engine.stop()

    recorder = Recorder()
    recorder.wrap(monkeypatch)
    engine = Engine(model, tok, 256, parallel=2, prefill_chunk=CHUNK)
    a_events, b_events, a_started = [], [], threading.Event()
    engine.start()
    try:
        engine.submit(job(tok("The sea is").input_ids, 60, a_events, a_started))
        assert a_started.wait(120)
        engine.submit(job(long_ids, 6, b_events))
        wait_done(b_events)
        wait_done(a_events)
    finally:
        engine.stop()
    a_gen, b_gen = (id(engine.slots[events[0]["slot"]].gen) for events in (a_events, b_events))
    steps, between = [], 0
    for gen, n in recorder.writes:
        if gen == b_gen:
            between += n
        elif n == 1:
            steps.append(between)
            between = 0
    b_prefill = sum(n for g, n in recorder.writes if g == b_gen) - 5  # its 5 reply tokens written after
    assert b_prefill >= len(long_ids) - 1
    assert max(steps) <= CHUNK, steps  # between two of A's tokens, at most one chunk of B's prompt
    assert sum(1 for s in steps if s > 0) >= len(long_ids) // CHUNK  # B's prompt spread over many steps
    assert reply(b_events) == reply(alone)  # read in chunks, it answers as a whole prefill does
    assert len(reply(a_events)) > 0
