"""The OpenAI-compatible HTTP API: routes, and the requests' way to the :class:`Engine` and back.

``/v1/completions`` and ``/v1/chat/completions`` (the model's chat template), both streamed as
server-sent events ending in ``data: [DONE]`` when ``stream`` is true; ``/v1/models``; ``/health``;
``/slots`` (state, save and restore); the chat page at ``/``. Responses carry OpenAI's ``usage`` with
``prompt_tokens_details.cached_tokens`` (prompt tokens taken from the cache) and a ``selfextend`` object
(slot, tokens moved by K-shift, context shifts, time to first token, tokens/s).

A request's body is read, turned into token ids, its sampling settings (a ``logit_bias``'s text keys
tokenised) and its response format (a JSON schema compiled) made on a worker thread (:func:`_prepare`),
so that a huge or slow one never holds up the others or ``/health``; a prompt over
``--max-prompt-tokens`` is a 400. A request whose client disconnects is cancelled, streamed or not: its
slot is free within a step. Once the engine's loop has ended, requests and ``/health`` get a 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from selfextend.generation.grammar import Grammar
from selfextend.generation.sampling import SamplingParams
from selfextend.server.engine import Engine, Job, Stopped
from selfextend.server.guard import APIError, Guard, error_body, install_error_handlers
from selfextend.server.llama_api import add_llama_routes
from selfextend.server.prompts import (
    Body,
    Prompt,
    chat_prompt,
    completion_prompt,
    longest_token,
    parse_json,
    read_body,
    too_long,
    validated,
)
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
PROMPT_CELLS = 4
"""The longest prompt a request may send, by default, in multiples of a slot's cells (--max-prompt-tokens)."""


@dataclass
class Settings:
    """What the command line decides for every request."""

    model_name: str
    api_key: str | None = None
    max_tokens: int = 4096  # the most a request may ask for
    default_max_tokens: int = 512  # for chat requests that do not say (completions: OpenAI's 16)
    max_body: int = 8 * 2**20
    max_prompt_tokens: int | None = None  # None: PROMPT_CELLS times a slot's cells
    sampling: SamplingParams = field(default_factory=SamplingParams)
    slot_save_path: str | None = None
    cors_origins: tuple[str, ...] = ()  # web pages of these origins may call the API ("*": any)


def create_app(engine: Engine, settings: Settings) -> FastAPI:
    """The FastAPI application over a started ``engine``."""
    app = FastAPI(title="selfextend", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(Guard, api_key=settings.api_key, max_body=settings.max_body)
    if settings.cors_origins:  # outside the guard: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            max_age=3600,
        )
    app.mount("/page", StaticFiles(directory=str(PAGE)), name="page")
    created = int(time.time())

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        busy = sum(s.busy for s in engine.slots)
        state = {"slots_idle": len(engine.slots) - busy, "slots_processing": busy}
        if engine.closed:
            return JSONResponse({"status": "error", "message": "the engine has stopped", **state}, 503)
        return JSONResponse({"status": "ok", **state})

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(str(PAGE / "index.html"))

    def described() -> dict[str, Any]:
        meta = {"n_ctx": engine.n_ctx, "n_parallel": len(engine.slots), "cache_reuse": engine.cache_reuse}
        model = {"id": settings.model_name, "object": "model", "created": created, "owned_by": "selfextend"}
        return {**model, "meta": meta}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [described()]}

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def model(model: str) -> dict[str, Any]:
        if model != settings.model_name:
            raise APIError(
                404,
                f"the model '{model}' does not exist (this server has '{settings.model_name}')",
                "model",
                "model_not_found",
            )
        return described()

    max_prompt = settings.max_prompt_tokens or PROMPT_CELLS * engine.n_ctx
    per_token = longest_token(engine.tokenizer)

    def completion(request: CompletionRequest) -> Prompt:
        return completion_prompt(engine.tokenizer, request.prompt, request.n_keep, engine.vocab, engine.n_ctx)

    def chat(request: ChatRequest) -> Prompt:
        try:
            return chat_prompt(engine.tokenizer, request.messages, request.n_keep, engine.n_ctx)
        except ValueError as e:
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from None

    async def answer(raw: Request, kind: type[Body], build: Callable[[Body], Prompt]):
        body = await raw.body()
        ready = await run_in_threadpool(_prepare, body, kind, build, engine, settings, max_prompt, per_token)
        return await _answer(engine, settings, ready, raw)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await answer(raw, CompletionRequest, completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await answer(raw, ChatRequest, chat)

    @app.api_route("/slots", methods=["GET", "HEAD"])
    async def slots() -> list[dict[str, Any]]:
        return engine.info()

    @app.post("/slots/{slot_id}")
    async def slot(slot_id: int, action: str, raw: Request) -> dict[str, Any]:
        body = await raw.body()  # save and restore: a file's name (JSON, any content type); erase: none read
        wants_name = action in ("save", "restore") and body.strip()
        named = validated(parse_json(body), SlotFile) if wants_name else None
        return await slot_action(engine, settings.slot_save_path, slot_id, action, named, settings.model_name)

    add_llama_routes(app, engine, settings.model_name, dataclasses.asdict(settings.sampling))
    return app


@dataclass
class Prepared:
    """A request made ready for the engine: its prompt, token limit, sampling settings, response format."""

    request: Sampling
    prompt: Prompt
    max_tokens: int
    sampling: SamplingParams
    grammar: Grammar | None


def _prepare(
    body: bytes,
    kind: type[Body],
    build: Callable[[Body], Prompt],
    engine: Engine,
    settings: Settings,
    max_prompt: int,
    per_token: int,
) -> Prepared:
    """``body`` as a ``kind`` request made ready (run on a worker thread: each step may take long): its
    prompt built (over ``max_prompt`` tokens: refused), its logit bias tokenised, its schema compiled."""
    request = read_body(body, kind, max_prompt, per_token)
    prompt = build(request)
    if len(prompt.ids) > max_prompt:
        raise too_long(len(prompt.ids), max_prompt)
    max_tokens = _check(engine, settings, request, prompt)
    try:
        sampling = sampling_params(request, settings.sampling, engine.tokenizer)
    except ValueError as e:
        raise APIError(400, str(e), None, "invalid_value") from None
    grammar = response_grammar(request, engine.tokenizer, engine.eos)
    return Prepared(request, prompt, max_tokens, sampling, grammar)


def _check(engine: Engine, settings: Settings, request: Sampling, prompt: Prompt) -> int:
    """Refuse what no slot can do; returns ``max_tokens``."""
    limit = settings.max_tokens
    asked, field = request.token_limit()
    max_tokens = asked or (settings.default_max_tokens if prompt.chat else 16)
    if max_tokens > limit:
        raise APIError(400, f"{field} must be at most {limit}, got {max_tokens}", field)
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


async def _answer(engine: Engine, settings: Settings, ready: Prepared, raw: Request):
    """Hand the request to the engine and answer with what it emits (streamed or whole)."""
    request, prompt = ready.request, ready.prompt
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
        sampling=ready.sampling,
        max_tokens=ready.max_tokens,
        emit=emit,
        seed=request.seed,
        stops=request.stops() + prompt.stops,
        slot_id=request.id_slot,
        cache_prompt=request.cache_prompt,
        ignore_eos=request.ignore_eos,
        draft_max=request.draft_max(),
        grammar=ready.grammar,
    )
    try:
        queued = engine.submit(job)
    except Stopped as e:
        raise APIError(503, str(e), None, "unavailable") from None
    if not queued:
        raise APIError(429, "the server is busy: too many requests waiting", None, "queue_full")
    shape = Shape(settings.model_name, prompt.chat)
    if request.stream:
        usage = request.stream_options is not None and request.stream_options.include_usage
        return StreamingResponse(_stream(engine, job, events, shape, usage), media_type="text/event-stream")
    text = []
    watch = asyncio.create_task(_watch(raw, events))
    try:
        while True:
            event = await events.get()
            if event["type"] == "text":
                text.append(event["text"])
            elif event["type"] == "error":
                return JSONResponse(_failure(event), status_code=event.get("status", 500))
            elif event["type"] == "done":
                return shape.whole("".join(text), event)
            elif event["type"] == "gone":
                return Response(status_code=499)  # no one reads it
    finally:
        watch.cancel()
        engine.cancel(job)  # a no-op once done; frees the slot if the client left first


async def _watch(raw: Request, events: asyncio.Queue) -> None:
    """Put a ``gone`` event in ``events`` once the client disconnects (a streaming response watches for that
    itself; a plain one would otherwise run on to ``max_tokens``)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass
    events.put_nowait({"type": "gone"})


def _failure(event: dict[str, Any]) -> dict[str, Any]:
    """The error body of an ``error`` event: a 500 (generation failed), or the status it names (503: the
    server stopped before the reply was done)."""
    if event.get("status") == 503:
        return error_body(503, event["message"], None, "unavailable")
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
        keys += ("draft_n", "draft_n_accepted")
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
