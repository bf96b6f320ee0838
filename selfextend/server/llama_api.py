"""llama-server's own endpoints, which its users script against: ``/tokenize``, ``/detokenize``,
``/apply-template``, ``/props`` and ``/metrics`` (Prometheus' text format).

Bodies and answers follow llama-server's: ``/tokenize`` takes ``content`` (and ``add_special``,
``with_pieces``) and answers ``tokens``; ``/detokenize`` takes ``tokens`` and answers ``content``;
``/apply-template`` takes chat ``messages`` and answers the ``prompt`` text the chat endpoint would read.
A body is JSON whatever its content type says, as there.
A piece that is part of a UTF-8 character is its bytes (a list of numbers), as there. Tokenising (and
decoding each token's piece) runs on a worker thread, so a large body does not hold up
other requests.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from selfextend.generation.text import token_piece
from selfextend.server.engine import Engine
from selfextend.server.guard import APIError
from selfextend.server.prompts import Model, check_text, parse_json, render_chat, validated
from selfextend.server.schemas import REQUEST_FIELDS, Message, Strict


class TokenizeRequest(Strict):
    content: str
    add_special: bool = False  # llama-server's default: no BOS
    parse_special: bool = True  # llama-server's: false reads special tokens' text as text
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    tokens: list[int]


class TemplateRequest(Strict):
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool = True  # False: the messages alone, without the assistant's header


def add_llama_routes(app: FastAPI, engine: Engine, model_name: str, defaults: dict[str, Any]) -> None:
    """Add llama-server's endpoints over ``engine`` to ``app``; ``defaults`` are the generation settings
    that ``/props`` reports."""
    tokenizer = engine.tokenizer
    params = {name: defaults[target] for name, target in REQUEST_FIELDS.items()}  # as requests name them

    async def body(raw: Request, kind: type[Model]) -> Model:
        return validated(parse_json(await raw.body()), kind)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict[str, Any]:
        request = await body(raw, TokenizeRequest)
        check_text(request.content, "content")

        def run() -> list[int] | list[dict[str, Any]]:
            split = not request.parse_special
            ids = tokenizer(
                request.content, add_special_tokens=request.add_special, split_special_tokens=split
            )
            ids = list(ids.input_ids)
            if not request.with_pieces:
                return ids
            return [{"id": t, "piece": token_piece(tokenizer, t)} for t in ids]

        return {"tokens": await run_in_threadpool(run) if request.content else []}

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict[str, Any]:
        request = await body(raw, DetokenizeRequest)
        if any(not 0 <= t < len(tokenizer) for t in request.tokens):
            raise APIError(400, f"token ids must be in [0, {len(tokenizer)})", "tokens")
        return {"content": await run_in_threadpool(tokenizer.decode, request.tokens)}

    @app.post("/apply-template")
    async def apply_template(raw: Request) -> dict[str, Any]:
        request = await body(raw, TemplateRequest)
        try:
            _, text = await run_in_threadpool(
                render_chat, tokenizer, request.messages, request.add_generation_prompt
            )
        except ValueError as e:
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from None
        return {"prompt": text}

    @app.api_route("/props", methods=["GET", "HEAD"])
    async def props() -> dict[str, Any]:
        return {
            "default_generation_settings": {"n_ctx": engine.n_ctx, "params": params},
            "total_slots": len(engine.slots),
            "model_path": model_name,
            "chat_template": getattr(tokenizer, "chat_template", None) or "",
            "modalities": {"vision": False, "audio": False},
            "build_info": f"selfextend {_version()}",
        }

    @app.api_route("/metrics", methods=["GET", "HEAD"], response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        store = engine.store
        stored = (store.hits, store.restored, store.nbytes) if store is not None else (0, 0, 0)
        text = engine.metrics.prometheus(engine.info(), len(engine.queue), stored)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _version() -> str:
    try:
        return version("selfextend")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
