"""The OpenAI-compatible HTTP API: routes, and the requests' way to the :class:`Engine` and back.

``/v1/completions`` and ``/v1/chat/completions`` (the model's chat template), both streamed as
server-sent events ending in ``data: [DONE]`` when ``stream`` is true; ``/v1/models``; ``/health``;
``/slots`` (state, save and restore); the chat page at ``/``. Responses carry OpenAI's ``usage`` with
``prompt_tokens_details.cached_tokens`` (prompt tokens taken from the cache) and a ``selfextend`` object
(slot, tokens moved by K-shift, context shifts, time to first token, tokens/s).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from selfextend.generation.sampling import SamplingParams
from selfextend.server.engine import Engine, Job
from selfextend.server.guard import APIError, Guard, error_body, install_error_handlers
from selfextend.server.prompts import Prompt, chat_prompt, completion_prompt
from selfextend.server.schemas import (
    ChatRequest,
    CompletionRequest,
    Sampling,
    SlotFile,
    response_grammar,
    sampling_params,
)
from selfextend.server.slotfiles import slot_action

PAGE = resources.files("selfextend.server") / "page"


@dataclass
class Settings:
    """What the command line decides for every request."""

    model_name: str
    api_key: str | None = None
    max_tokens: int = 4096  # the most a request may ask for
    default_max_tokens: int = 512  # for chat requests that do not say (completions: OpenAI's 16)
    max_body: int = 8 * 2**20
    sampling: SamplingParams = field(default_factory=SamplingParams)
    slot_save_path: str | None = None


def create_app(engine: Engine, settings: Settings) -> FastAPI:
    """The FastAPI application over a started ``engine``."""
    app = FastAPI(title="selfextend", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(Guard, api_key=settings.api_key, max_body=settings.max_body)
    app.mount("/page", StaticFiles(directory=str(PAGE)), name="page")
    created = int(time.time())

    @app.get("/health")
    async def health() -> dict[str, Any]:
        busy = sum(s.busy for s in engine.slots)
        return {"status": "ok", "slots_idle": len(engine.slots) - busy, "slots_processing": busy}

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(str(PAGE / "index.html"))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        meta = {"n_ctx": engine.n_ctx, "n_parallel": len(engine.slots), "cache_reuse": engine.cache_reuse}
        model = {"id": settings.model_name, "object": "model", "created": created, "owned_by": "selfextend"}
        return {"object": "list", "data": [{**model, "meta": meta}]}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        prompt = completion_prompt(engine.tokenizer, request.prompt, request.n_keep)
        return await _answer(engine, settings, request, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest):
        try:
            prompt = chat_prompt(engine.tokenizer, request.messages, request.n_keep)
        except ValueError as e:
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from None
        return await _answer(engine, settings, request, prompt, chat=True)

    @app.get("/slots")
    async def slots() -> list[dict[str, Any]]:
        return engine.info()

    @app.post("/slots/{slot_id}")
    async def slot(slot_id: int, action: str, body: SlotFile | None = None) -> dict[str, Any]:
        return await slot_action(engine, settings.slot_save_path, slot_id, action, body, settings.model_name)

    return app


def _check(engine: Engine, settings: Settings, request: Sampling, prompt: Prompt) -> int:
    """Refuse what no slot can do; returns ``max_tokens``."""
    limit = settings.max_tokens
    max_tokens = request.max_tokens or (settings.default_max_tokens if prompt.chat else 16)
    if max_tokens > limit:
        raise APIError(400, f"max_tokens must be at most {limit}, got {max_tokens}", "max_tokens")
    if not prompt.ids:
        raise APIError(400, "the prompt is empty", "prompt")
    if prompt.n_keep > engine.n_ctx - 2:
        raise APIError(
            400,
            f"{prompt.n_keep} tokens to keep at every context shift (the system prompt or n_keep) leave no "
            f"room in a context of {engine.n_ctx}",
            "n_keep" if request.n_keep is not None else "messages",
            "context_length_exceeded",
        )
    if request.id_slot is not None and request.id_slot >= len(engine.slots):
        raise APIError(400, f"id_slot must be below {len(engine.slots)}", "id_slot")
    return max_tokens


async def _answer(engine: Engine, settings: Settings, request: Sampling, prompt: Prompt, chat: bool):
    max_tokens = _check(engine, settings, request, prompt)
    try:
        sampling = sampling_params(request, settings.sampling, engine.tokenizer)
    except ValueError as e:
        raise APIError(400, str(e), None, "invalid_value") from None
    grammar = response_grammar(request, engine.tokenizer, engine.eos)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def emit(event: dict[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (the server stopped past its drain): no one listens
            job.cancelled.set()

    job = Job(
        prompt=prompt.ids,
        n_keep=prompt.n_keep,
        sampling=sampling,
        max_tokens=max_tokens,
        emit=emit,
        seed=request.seed,
        stops=request.stops() + prompt.stops,
        slot_id=request.id_slot,
        cache_prompt=request.cache_prompt,
        ignore_eos=request.ignore_eos,
        grammar=grammar,
    )
    if not engine.submit(job):
        raise APIError(429, "the server is busy: too many requests waiting", None, "queue_full")
    shape = Shape(settings.model_name, chat)
    if request.stream:
        usage = request.stream_options is not None and request.stream_options.include_usage
        return StreamingResponse(_stream(engine, job, events, shape, usage), media_type="text/event-stream")
    text = []
    try:
        while True:
            event = await events.get()
            if event["type"] == "text":
                text.append(event["text"])
            elif event["type"] == "error":
                return JSONResponse(_failure(event), status_code=500)
            elif event["type"] == "done":
                return shape.whole("".join(text), event)
    finally:
        engine.cancel(job)  # a no-op once done; frees the slot if the client left first


def _failure(event: dict[str, Any]) -> dict[str, Any]:
    return error_body(500, f"generation failed: {event['message']}")


async def _stream(
    engine: Engine, job: Job, events: asyncio.Queue, shape: Shape, usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text, the finish chunk, usage if asked, ``[DONE]``."""
    try:
        if shape.chat:
            yield _sse(shape.chunk({"role": "assistant", "content": ""}, None))
        while True:
            event = await events.get()
            if event["type"] == "text":
                yield _sse(shape.chunk({"content": event["text"]} if shape.chat else event["text"], None))
            elif event["type"] == "error":
                yield _sse(_failure(event))
                break
            elif event["type"] == "done":
                last = shape.chunk({} if shape.chat else "", event["finish_reason"])
                last["selfextend"] = shape.stats(event)
                yield _sse(last)
                if usage:
                    yield _sse({**shape.chunk(None, None), "choices": [], "usage": shape.usage(event)})
                break
        yield "data: [DONE]\n\n"
    finally:
        engine.cancel(job)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Shape:
    """OpenAI's response objects for one request (chat or text completion)."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta: Any, finish_reason: str | None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    @staticmethod
    def usage(event: dict[str, Any]) -> dict[str, Any]:
        p, c = event["prompt_tokens"], event["completion_tokens"]
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": event["cached_tokens"]},
        }

    @staticmethod
    def stats(event: dict[str, Any]) -> dict[str, Any]:
        keys = ("slot", "cached_tokens", "moved_tokens", "shifts", "ttft_s", "tokens_per_second")
        return {k: event[k] for k in keys}

    def whole(self, text: str, event: dict[str, Any]) -> dict[str, Any]:
        reason = event["finish_reason"]
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": self.usage(event), "selfextend": self.stats(event)}
