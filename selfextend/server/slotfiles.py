"""Slot save, restore and erase (``POST /slots/{id}?action=...``), as llama-server's, in prompt-cache files.

A file is named by the request (a plain name, no folders) and lives under ``--slot-save-path``. It holds
the slot's cells and tokens in the prompt-cache format (:mod:`selfextend.kv.promptcache`), so it loads
only into the same model and settings, and the slot's kept count and history beside them.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import torch

from selfextend.kv import promptcache
from selfextend.server.engine import Engine
from selfextend.server.guard import APIError
from selfextend.server.schemas import SlotFile
from selfextend.server.slots import Slot

SLOT_KIND = "selfextend-slot/1"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _path(folder: str | None, body: SlotFile | None) -> Path:
    if folder is None:
        raise APIError(400, "slot files need the server started with --slot-save-path", "action")
    if body is None or not NAME.fullmatch(body.filename) or ".." in body.filename:
        raise APIError(400, "filename must be a plain file name (letters, digits, . _ -)", "filename")
    return Path(folder) / body.filename


def save(slot: Slot, path: Path) -> dict[str, Any]:
    """Write the slot's cache, tokens and history to ``path``."""
    gen = slot.gen
    if gen is None or not gen.tokens:
        raise APIError(400, f"slot {slot.id} holds nothing to save", "id_slot")
    logits = gen.last_logits if gen.last_logits is not None else torch.zeros(0)
    extra = {"kind": SLOT_KIND, "n_keep": gen.cache.n_keep, "history": slot.history}
    promptcache.save(path, slot.model, gen.cache, gen.tokens, logits, extra=extra)
    return {"id_slot": slot.id, "filename": path.name, "n_saved": len(gen.tokens)}


def restore(slot: Slot, path: Path) -> dict[str, Any]:
    """Replace the slot's cache by the one saved in ``path`` (same model and settings only)."""
    if not path.is_file():
        raise APIError(404, f"no slot file {path.name}", "filename")
    gen = slot.generator(slot.gen.cache.n_keep if slot.gen else 0)
    try:
        payload = promptcache.read(path, slot.model, gen.cache)
        extra = json.loads(payload.get("extra") or "{}")
        if not isinstance(extra, dict) or extra.get("kind") != SLOT_KIND:
            raise promptcache.PromptCacheError(f"{path.name} is not a slot file")
        tokens = payload["tokens"].tolist()
        n_keep, history = extra.get("n_keep"), extra.get("history")
        ok = isinstance(history, list) and all(type(t) is int for t in history)
        if not (ok and type(n_keep) is int and 0 <= n_keep <= slot.n_ctx - 2 and len(tokens) <= slot.n_ctx):
            raise promptcache.PromptCacheError(f"{path.name}: damaged slot state")
        gen = slot.generator(n_keep)
        gen.cache.load_prefix(payload["keys"], payload["values"], len(tokens), promptcache.positions(payload))
    except (promptcache.PromptCacheError, ValueError) as e:
        slot.reset()
        raise APIError(400, str(e), "filename") from None
    gen.tokens = tokens
    gen.last_logits = payload["logits"] if payload["logits"].numel() else None
    slot.history = history
    return {"id_slot": slot.id, "filename": path.name, "n_restored": len(tokens)}


def erase(slot: Slot) -> dict[str, Any]:
    n = len(slot.gen.tokens) if slot.gen else 0
    slot.reset()
    return {"id_slot": slot.id, "n_erased": n}


async def slot_action(
    engine: Engine, folder: str | None, slot_id: int, action: str, body: SlotFile | None
) -> dict[str, Any]:
    """Run ``action`` (save, restore, erase) on an idle slot, on the engine's thread."""
    if not 0 <= slot_id < len(engine.slots):
        raise APIError(404, f"no slot {slot_id}", "id_slot")
    if action == "erase":
        work = erase
    elif action in ("save", "restore"):
        path = _path(folder, body)
        work = (lambda s: save(s, path)) if action == "save" else (lambda s: restore(s, path))
    else:
        raise APIError(400, f"action must be save, restore or erase, got {action!r}", "action")
    try:
        return await asyncio.to_thread(engine.with_slot, slot_id, work)
    except LookupError as e:
        raise APIError(409, str(e), "id_slot") from None
