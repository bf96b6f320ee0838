"""Slot save, restore and erase (``POST /slots/{id}?action=...``), as llama-server's, in prompt-cache files.

A file is named by the request (a plain name, no folders) and lives under ``--slot-save-path``. It holds
the slot's cells and tokens in the prompt-cache format (:mod:`selfextend.kv.promptcache`), with the model's
fingerprint, dtype, weight format and Self-Extend settings, and beside them the slot's kept count and
history and the server's settings: the model as named by ``-m``, ``--ctx`` and the cache's element type.
It restores only into a server with the same settings; a difference is a 400 naming both values. A
``selfextend-slot/1`` file (without the server's settings) is checked on the cache's settings alone.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import torch

from selfextend.kv import promptcache
from selfextend.server.engine import Engine, Stopped
from selfextend.server.guard import APIError
from selfextend.server.schemas import SlotFile
from selfextend.server.slots import Slot

SLOT_KIND = "selfextend-slot/2"
OLD_KINDS = ("selfextend-slot/1",)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _path(folder: str | None, body: SlotFile | None) -> Path:
    if folder is None:
        raise APIError(400, "slot files need the server started with --slot-save-path", "action")
    if body is None or not NAME.fullmatch(body.filename) or ".." in body.filename:
        raise APIError(400, "filename must be a plain file name (letters, digits, . _ -)", "filename")
    return Path(folder) / body.filename


def setup(slot: Slot, model_name: str) -> dict[str, Any]:
    """The server settings a slot file records besides :func:`~selfextend.kv.promptcache.settings`."""
    dtype = slot.gen.cache.layers[0].keys.dtype if slot.gen else slot.cache_dtype
    cache_type = str(dtype or next(slot.model.parameters()).dtype)
    return {"model": model_name, "ctx": slot.n_ctx, "cache_type": cache_type.removeprefix("torch.")}


FLAGS = {"model": "-m", "ctx": "--ctx", "cache_type": "a KV cache of"}


def _check_setup(name: str, payload: dict[str, Any], saved: dict[str, Any], now: dict[str, Any]) -> None:
    """A 400 naming both values where the file's model, settings or server settings differ from the
    server's (the model by its fingerprint: the same model named another way restores)."""
    ours, theirs = now["cache"], json.loads(payload["settings"])
    if theirs.get("model") != ours["model"]:
        named = f"-m {saved['model']}, " if "model" in saved else ""  # a /1 file does not say
        raise APIError(
            400,
            f"slot file {name} was saved with another model ({named}fingerprint {theirs.get('model')}); "
            f"this server runs -m {now['model']} (fingerprint {ours['model']})",
            "filename",
        )
    diffs = [
        (promptcache.describe(k, theirs.get(k)), promptcache.describe(k, v))
        for k, v in ours.items()
        if theirs.get(k) != v
    ]
    diffs += [
        (f"{FLAGS[k]} {saved[k]}", f"{FLAGS[k]} {now[k]}")
        for k in ("ctx", "cache_type")
        if k in saved and saved[k] != now[k]
    ]
    if diffs:
        file, server = (", ".join(d[i] for d in diffs) for i in (0, 1))
        raise APIError(400, f"slot file {name} was saved with {file}; this server runs {server}", "filename")


def save(slot: Slot, path: Path, model_name: str) -> dict[str, Any]:
    """Write the slot's cache, tokens, history and settings to ``path``; a 400 where something that is not
    a saved cache (a folder, another file) has that name: it is never replaced."""
    gen = slot.gen
    if gen is None or not gen.tokens:
        raise APIError(400, f"slot {slot.id} holds nothing to save", "id_slot")
    if not promptcache.may_replace(path):
        raise APIError(400, f"{path.name} is there and is not a saved cache: not replaced", "filename")
    logits = gen.last_logits if gen.last_logits is not None else torch.zeros(0)
    extra = {"kind": SLOT_KIND, "n_keep": gen.cache.n_keep, "history": slot.history}
    extra["setup"] = setup(slot, model_name)
    try:
        promptcache.save(path, slot.model, gen.cache, gen.tokens, logits, extra=extra)
    except OSError as e:  # a full disk, a folder made read-only: the server's trouble, said without a trace
        raise APIError(500, f"cannot write slot file {path.name}: {e.strerror or type(e).__name__}") from None
    return {"id_slot": slot.id, "filename": path.name, "n_saved": len(gen.tokens)}


def _read(slot: Slot, path: Path, model_name: str) -> tuple[dict[str, Any], int, list[int]]:
    """(the payload, n_keep, history) of the slot file at ``path``, checked against the server's model and
    settings and for damage: PromptCacheError or APIError, with the slot untouched."""
    payload = promptcache.peek(path)
    extra = json.loads(payload.get("extra") or "{}")
    if not isinstance(extra, dict) or extra.get("kind") not in (SLOT_KIND, *OLD_KINDS):
        raise promptcache.PromptCacheError(f"{path.name} is not a slot file")
    saved = extra.get("setup", {})
    if not isinstance(saved, dict):
        raise promptcache.PromptCacheError(f"{path.name}: damaged slot state")
    now = {**setup(slot, model_name), "cache": promptcache.settings(slot.model)}
    _check_setup(path.name, payload, saved, now)
    n_keep, history = extra.get("n_keep"), extra.get("history")
    rows = slot.model.get_input_embeddings().num_embeddings
    ok = isinstance(history, list) and all(type(t) is int and 0 <= t < rows for t in history)
    if not (
        ok and type(n_keep) is int and 0 <= n_keep <= slot.n_ctx - 2 and len(payload["tokens"]) <= slot.n_ctx
    ):
        raise promptcache.PromptCacheError(f"{path.name}: damaged slot state")
    held = slot.gen.cache if slot.gen else slot.generator(0).cache  # as it is: no cell changed
    promptcache.check(path, payload, slot.model, held)
    return payload, n_keep, history


def restore(slot: Slot, path: Path, model_name: str) -> dict[str, Any]:
    """Replace the slot's cache by the one saved in ``path`` (same model and settings only). A file that is
    refused leaves the slot as it was; one that fails while it loads leaves it empty, never half-loaded."""
    if not path.is_file():
        raise APIError(404, f"no slot file {path.name}", "filename")
    try:
        payload, n_keep, history = _read(slot, path, model_name)
    except (promptcache.PromptCacheError, ValueError) as e:
        raise APIError(400, str(e).replace(str(path), path.name), "filename") from None
    tokens = payload["tokens"].tolist()
    try:
        gen = slot.generator(n_keep)
        gen.cache.load_prefix(payload["keys"], payload["values"], len(tokens), promptcache.positions(payload))
        gen.tokens = tokens
        gen.last_logits = payload["logits"] if payload["logits"].numel() else None
        slot.history = history
    except BaseException:
        slot.reset()
        raise
    return {"id_slot": slot.id, "filename": path.name, "n_restored": len(tokens)}


def erase(slot: Slot) -> dict[str, Any]:
    n = len(slot.gen.tokens) if slot.gen else 0
    slot.reset()
    return {"id_slot": slot.id, "n_erased": n}


async def slot_action(
    engine: Engine, folder: str | None, slot_id: int, action: str, body: SlotFile | None, model_name: str
) -> dict[str, Any]:
    """Run ``action`` (save, restore, erase) on an idle slot, on the engine's thread; ``model_name``: the
    model as the server was told it (recorded in slot files)."""
    if not 0 <= slot_id < len(engine.slots):
        raise APIError(404, f"no slot {slot_id}", "id_slot")
    if action == "erase":
        work = erase
    elif action in ("save", "restore"):
        path = _path(folder, body)
        act = save if action == "save" else restore
        work = lambda s: act(s, path, model_name)  # noqa: E731
    else:
        raise APIError(400, f"action must be save, restore or erase, got {action!r}", "action")
    try:
        return await asyncio.to_thread(engine.with_slot, slot_id, work)
    except LookupError as e:
        raise APIError(409, str(e), "id_slot") from None
    except (Stopped, TimeoutError) as e:
        raise APIError(503, str(e)) from None
