"""The engine: the one thread that runs the model, every request on a slot, a token at a time.

``serve`` runs it on the main thread (the one that loaded the model), the HTTP server beside it: libgomp
keeps a worker pool per thread that starts parallel work, and with more pooled threads than cores every
parallel region waits for sleeping workers (a Gemma 3 token: 16 ms on a second thread, 10.5 on the main).

Requests wait in a queue until a slot is free (the one holding most of their prompt, :func:`pick`). Each
turn of the loop writes one chunk of at most ``prefill_chunk`` prompt tokens (of the oldest request still
reading its prompt; context shifts included), then gives every request past its prompt its next token,
as llama-server splits prompts into batches between decode steps: a long new prompt delays the running
streams by at most one chunk per token (a request's first token comes once its whole prompt is written).
The requests past their prompt decode together, in one batched forward where the model allows
(:class:`~selfextend.generation.batched.BatchedDecode`: continuous batching), else one after the other.
So ``--parallel N`` requests progress together, and a request whose client left (:attr:`Job.cancelled`)
ends within a step and frees its slot. Results go back through each job's ``emit`` (thread-safe there).
A failure (a step that raises, NaN logits) ends only its requests, with an ``error`` event, their slots
left consistent (:meth:`Slot.recover`); whoever still waits when the loop ends is answered.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from selfextend.generation.backends import decode_backends
from selfextend.generation.batched import BatchedDecode
from selfextend.generation.draft import DraftModel
from selfextend.generation.generator import PREFILL_CHUNK, run
from selfextend.generation.grammar import NoTokenLeft
from selfextend.generation.speculative import draft_and_check, speculates
from selfextend.generation.text import StopMatcher, TextStream, eos_token_ids
from selfextend.models.blocks import set_chunk_engine
from selfextend.models.heap import release_free_memory
from selfextend.server.jobs import Job, Running, Stopped
from selfextend.server.metrics import Metrics
from selfextend.server.promptstore import PromptStore
from selfextend.server.slots import Slot, pick

__all__ = ["Engine", "Job", "Stopped"]

SLOT_WAIT_S = 120.0  # the longest a slot action waits to be taken (between turns; a turn reads whole prompts)


class Engine:
    """Runs jobs on ``parallel`` slots of ``n_ctx`` cells each (of ``cache_dtype``, None: the model's), from
    one background thread; prompts are written ``prefill_chunk`` tokens a turn, by int8 block products (so
    replies do not change with batching or cache reuse: :func:`set_chunk_engine`). ``cache_ram``: bytes
    of cells kept of conversations whose slot went to another (:class:`PromptStore`; 0: none)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        n_ctx: int,
        parallel: int = 1,
        cache_reuse: int = 0,
        max_queue: int = 64,
        prefill_chunk: int = PREFILL_CHUNK,
        cache_dtype: torch.dtype | None = None,
        cache_ram: int = 0,
        lookup: int = 0,
        draft: DraftModel | None = None,
    ) -> None:
        """``lookup``: tokens drafted per slot and turn by prompt lookup; ``draft``: by a draft model."""
        self.model, self.tokenizer, self.n_ctx = model, tokenizer, n_ctx
        self.most = lookup if draft is None else draft.most  # drafts per slot and pass at most
        rows = getattr(model.get_input_embeddings(), "num_embeddings", len(tokenizer))
        self.vocab = min(len(tokenizer), rows)  # ids a prompt may hold: never past the table's rows
        set_chunk_engine(model, default="int8")
        self.cache_reuse, self.max_queue, self.prefill_chunk = cache_reuse, max_queue, prefill_chunk
        self.eos = eos_token_ids(model, tokenizer)
        steps = decode_backends(model)  # one for all slots; their batches go through them or BatchedDecode
        self.slots = [
            Slot(i, model, n_ctx, steps, cache_dtype, None if draft is None else draft.for_another())
            for i in range(parallel)
        ]
        self.batched = BatchedDecode(model)
        self.metrics = Metrics()
        self.store = PromptStore(cache_ram) if cache_ram > 0 else None
        self.queue: deque[Job] = deque()
        self.running: list[Running] = []
        self.tasks: list[Callable[[], None]] = []  # work on idle slots (save, restore), run between steps
        self.wake = threading.Condition()
        self.stopping = False
        self.hurry = False  # stop(now=True): the loop ends without finishing the jobs in hand
        self.closed = False  # the loop has ended: work handed in now is refused
        self.thread = threading.Thread(target=self.run_loop, name="selfextend-engine", daemon=True)

    # --- called from the server's threads ----------------------------------------------------------

    def start(self) -> None:
        """Run the engine on a thread of its own (:meth:`run_loop` runs it on the caller's)."""
        self.thread.start()

    def stop(self, now: bool = False) -> None:
        """End the loop once the jobs in hand are done (joined where it runs on its own thread); ``now``: at
        the next token, the jobs in hand each end with an error event (a stream gets it, then ``[DONE]``)."""
        with self.wake:
            self.stopping = True
            self.hurry = self.hurry or now
            self.wake.notify()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join()

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False when the queue is full, :class:`Stopped` once the loop has ended."""
        with self.wake:
            if self.closed:
                raise Stopped("the server is stopping")
            if len(self.queue) >= self.max_queue:
                return False
            self.queue.append(job)
            self.wake.notify()
        return True

    def cancel(self, job: Job) -> None:
        job.cancelled.set()
        with self.wake:
            self.wake.notify()

    def with_slot(self, slot_id: int, action: Callable[[Slot], Any], wait: float = SLOT_WAIT_S) -> Any:
        """Run ``action(slot)`` on the engine's thread while the slot is idle; returns its result or raises
        its exception. ``LookupError`` when the slot is busy, :class:`Stopped` once the loop has ended,
        ``TimeoutError`` (nothing done) when the loop has not taken it within ``wait`` seconds."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def task() -> None:
            slot = self.slots[slot_id]
            try:
                if self.closed:
                    raise Stopped("the server is stopping")
                if slot.busy:
                    raise LookupError(f"slot {slot_id} is busy")
                box["value"] = action(slot)
            except Exception as e:  # handed back to the caller's thread
                box["error"] = e
            done.set()

        with self.wake:
            if self.closed:
                raise Stopped("the server is stopping")
            self.tasks.append(task)
            self.wake.notify()
        if not done.wait(wait):
            with self.wake:
                if task in self.tasks:  # not taken yet: withdrawn
                    self.tasks.remove(task)
                    raise TimeoutError(f"slot {slot_id}: the server was busy for {wait:g} s; try again")
            done.wait()  # taken: its action is under way
        if "error" in box:
            raise box["error"]
        return box["value"]

    def info(self) -> list[dict[str, Any]]:
        """Each slot's state, for /slots."""
        return [
            {
                "id": s.id,
                "is_processing": s.busy,
                "n_ctx": s.n_ctx,
                "n_past": s.gen.cache.n_past if s.gen else 0,
                "shifts": s.gen.cache.shifts if s.gen else 0,
                "cache_type": s.cache_type(),
            }
            for s in self.slots
        ]

    # --- the engine's thread -----------------------------------------------------------------------

    def run_loop(self) -> None:
        """The engine's loop on the calling thread, until :meth:`stop` is called from another."""
        try:
            with torch.no_grad():
                self._loop()
        finally:
            self._close()

    def _loop(self) -> None:
        while True:
            with self.wake:
                while not (self.queue or self.running or self.tasks or self.stopping):
                    self.wake.wait()
                if self.stopping and (self.hurry or not (self.queue or self.running or self.tasks)):
                    return
                starting = self._assign()
                tasks, self.tasks = self.tasks, []
            for task in tasks:
                task()
            for job, slot in starting:
                self._start(job, slot)
            self._turn()

    def _close(self) -> None:
        """Answer everyone still waiting once the loop has ended (no one, unless it ended by an error it
        could not handle): queued and running requests get an error, slot actions :class:`Stopped`."""
        with self.wake:
            self.closed = True
            tasks, self.tasks = self.tasks, []
            jobs = [*self.queue, *(r.job for r in self.running)]
            self.queue.clear()
            self.running = []
        for task in tasks:
            task()
        for job in jobs:
            job.emit({"type": "error", "message": "the server is stopping", "status": 503})

    def _assign(self) -> list[tuple[Job, Slot]]:
        """Take queued jobs that have a free slot (in order; a job waiting for a busy slot it asked for
        does not hold up the others)."""
        out = []
        for job in list(self.queue):
            if job.cancelled.is_set():
                self.queue.remove(job)
                self.metrics.count("cancelled")
                continue
            slot = pick(self.slots, job.prompt if job.cache_prompt else [], job.slot_id)
            if slot is not None:
                slot.busy = True
                self.queue.remove(job)
                out.append((job, slot))
        return out

    def _start(self, job: Job, slot: Slot) -> None:
        started = time.perf_counter()
        try:
            if self.store is not None and job.cache_prompt:
                self.store.swap(slot, job.prompt)
            reuse = slot.prepare(job.prompt, job.n_keep, self.cache_reuse, job.cache_prompt)
            gen = slot.gen
            gen.sampling, gen.grammar = job.sampling, job.grammar
            gen.draft = slot.draft if self._most(job) else None  # no drafts asked: the draft model idle
            if job.seed is None:
                gen.rng.seed()
            else:
                gen.rng.manual_seed(job.seed)
        except Exception as e:
            self._fail(job, slot, e)
            return
        stops = StopMatcher(job.stops, self.tokenizer)
        r = Running(
            job,
            slot,
            reuse,
            reuse.tokens,
            None,
            TextStream(self.tokenizer),
            stops,
            gen.cache.shifts,
            started,
            (gen.drafted, gen.kept),
        )
        self.running.append(r)
        job.emit({"type": "start", "slot": slot.id, "reused": reuse.tokens})

    def _fail(self, job: Job, slot: Slot, error: Exception) -> None:
        """End ``job`` on an error: its slot back to what it holds for certain, and free."""
        slot.recover()
        slot.finish(job.prompt, [], complete=False)
        slot.busy = False
        self.metrics.count("failed")
        job.emit({"type": "error", "message": str(error) or type(error).__name__})

    def _drop(self, r: Running, error: Exception) -> None:
        """End a running job on an error (:meth:`_fail`)."""
        if r.tokens is not None:
            r.tokens.close()
        if r in self.running:
            self.running.remove(r)
        self._fail(r.job, r.slot, error)

    def _turn(self) -> None:
        """One step: a chunk of the oldest prompt still being read (its first token once it is all written),
        then the next token of every job past its prompt in one batched decode. An error ends only its job."""
        decoding, reading = [], []
        for r in list(self.running):
            try:
                if r.job.cancelled.is_set():
                    self._end(r, "cancelled")
                elif r.stats is None:
                    reading.append(r)
                else:
                    decoding.append(r)
            except Exception as e:
                self._drop(r, e)
        if reading:
            self._read(reading[0])
        if decoding:
            self._decode(decoding)

    def _read(self, r: Running) -> None:
        """Write the next chunk of ``r``'s prompt; after the last, its last token alone (through the path of
        every later token, :func:`~selfextend.generation.generator.run`) and the first token drawn."""
        prompt, gen = r.job.prompt, r.slot.gen
        last = len(prompt) - 1
        try:
            if r.written < last:
                end = min(last, r.written + self.prefill_chunk)
                gen.feed(prompt[r.written : end], min(self.prefill_chunk, gen.cache.max_chunk()))
                done, r.written = end - r.written, end
                if end < last or done == self.prefill_chunk:  # the last token in the next turn's chunk
                    return
            if r.tokens is None:
                r.tokens = run(gen, prompt, 1, self.eos, r.written)
            token, r.stats = next(r.tokens)
            r.tokens.close()
            self._accept(r, token)
        except StopIteration:
            self._end(r, "length")
        except NoTokenLeft as e:
            self._end(r, "stop" if e.accepting else "length")
        except Exception as e:  # a failure inside the model or past it: this job ends, the server goes on
            self._drop(r, e)

    def _decode(self, rs: list[Running]) -> None:
        """Write each job's last token (one forward for all where the model allows) and sample the next;
        with drafts (``lookup`` or a draft model), a job's drafts are written beside it and the ones the rule
        keeps (greedy: those greedy decoding agrees with) taken."""
        drafted = [r for r in rs if self._most(r.job) and speculates(r.slot.gen) is None]
        if drafted:
            self._decode_drafted(drafted)
            rs = [r for r in rs if r not in drafted]
            if not rs:
                return
        try:
            logits = self.batched([(r.slot.gen, r.generated[-1]) for r in rs])
        except Exception as e:  # a failure inside the model: these jobs end, the server goes on
            for r in rs:
                self._drop(r, e)
            return
        for r, row in zip(rs, logits, strict=True):
            try:
                self._accept(r, r.slot.gen.next_token(row))
            except NoTokenLeft as e:  # the bias bans what the response format allows: the reply ends here
                self._end(r, "stop" if e.accepting else "length", written=True)
            except Exception as e:  # no token to sample (NaN or inf logits): this job ends, the others go on
                self._drop(r, e)

    def _most(self, job: Job) -> int:
        """Drafts ``job`` takes per pass at most: the server's, or fewer where the request says so."""
        return self.most if job.draft_max is None else min(self.most, job.draft_max)

    def _decode_drafted(self, rs: list[Running]) -> None:
        """The slots' tokens and their drafts checked in one pass; each kept draft streamed as a token
        of its own. A job that ends inside its run leaves its cache at what it wrote (a plain step's)."""
        room = [min(self._most(r.job), r.job.max_tokens - len(r.generated) - 1) for r in rs]
        try:
            done = draft_and_check([(r.slot.gen, r.generated[-1], n) for r, n in zip(rs, room, strict=True)])
        except Exception as e:  # a failure inside the model: these jobs end, the server goes on
            for r in rs:
                self._drop(r, e)
            return
        for r, (tokens, base) in zip(rs, done, strict=True):
            for j, token in enumerate(tokens):
                self._accept(r, token)
                if r not in self.running:
                    if r.slot.gen.cache.n_past > base + j + 1:
                        r.slot.gen.rewind(base + j + 1)
                    break

    def _accept(self, r: Running, token: int) -> None:
        """Stream ``token``'s text; end the job on EOS, a stop string or its token limit."""
        job = r.job
        if r.first_token is None:
            r.first_token = time.perf_counter()
        r.generated.append(token)
        if token in self.eos and not job.ignore_eos:
            return self._end(r, "stop")
        text, stopped = r.stops.push(r.stream.push(token), token)
        if text:
            job.emit({"type": "text", "text": text})
        if stopped:
            return self._end(r, "stop")
        if len(r.generated) >= job.max_tokens:
            return self._end(r, "length")

    def _end(self, r: Running, reason: str, written: bool = False) -> None:
        """End ``r`` for ``reason``: text held back for a stop string sent (unless cancelled), the slot
        free. ``written``: the last token drawn is in the cache too (no token came after it)."""
        if r.tokens is not None:
            r.tokens.close()
        self.running.remove(r)
        slot, job = r.slot, r.job
        tail = r.stops.flush()
        if tail and reason != "cancelled":
            job.emit({"type": "text", "text": tail})
        slot.finish(job.prompt, r.generated if written else r.generated[:-1], r.stats is not None)
        slot.busy = False
        release_free_memory()  # prompts of every size leave freed heap pages resident in glibc's arenas
        if reason == "cancelled":
            return self.metrics.count("cancelled")
        done = r.report(reason, reason == "stop" and bool(r.generated) and r.generated[-1] in self.eos)
        self.metrics.record(done)
        job.emit({"type": "done", **done})
