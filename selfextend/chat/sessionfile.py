"""Chat session files: the chat's state saved beside the cells of a prompt-cache file, and the settings the
session was made with, read back before any model is loaded so that a resumed chat needs no flags.

A session file is a prompt-cache file (:mod:`selfextend.kv.promptcache`) whose ``extra`` holds the
state below. Its kind ``selfextend-chat/2`` adds the model as named on the command line and the KV
cache's element type; a ``selfextend-chat/1`` file lacks them and is converted on load (no model name,
the element type of its saved cells).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from selfextend.generation.settings import CACHE_DTYPES
from selfextend.kv import promptcache

SESSION_KIND = "selfextend-chat/2"
OLD_KINDS = ("selfextend-chat/1",)


class ChatError(ValueError):
    """A chat request that cannot be done (nothing to undo, a session file that does not fit); one line."""


@dataclass
class ChatStats:
    """Totals over a session (saved in its file): prefilled and generated tokens, their time, replies."""

    replies: int = 0
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    last_tokens: int = 0
    last_seconds: float = 0.0

    @staticmethod
    def rate(tokens: int, seconds: float) -> float:
        return tokens / seconds if seconds > 0 else 0.0


STATE_FIELDS = {
    "n_ctx": int,
    "n_keep": int,
    "keep": (int, type(None)),
    "system": (str, type(None)),
    "closed": bool,
    "exchanges": list,
    "shifts": int,
    "discarded": int,
    "dropped_exchanges": int,
    "stats": dict,
    "rng": list,
}
NEW_FIELDS = {"model": (str, type(None)), "cache_type": str}
"""What ``selfextend-chat/2`` added to ``/1``'s fields."""


def cache_type_name(dtype: torch.dtype) -> str:
    """The ``--cache-type`` name (llama.cpp's: f32, bf16, f16) of a cache element type."""
    names = {v: k for k, v in CACHE_DTYPES.items()}
    if dtype not in names:
        raise ChatError(f"a KV cache of {dtype} has no --cache-type name")
    return names[dtype]


def session_state(payload: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The chat's state saved beside the cells, with every field of the type it must have; a ``/1`` state
    gets the fields ``/2`` added (``model`` None, ``cache_type`` from the saved cells)."""
    if "extra" not in payload:
        raise ChatError(f"{path} is a prompt cache, not a chat session")
    try:
        state = json.loads(payload["extra"])
    except (TypeError, ValueError):
        raise ChatError(f"{path}: unreadable session state") from None
    if not isinstance(state, dict) or state.get("kind") not in (SESSION_KIND, *OLD_KINDS):
        raise ChatError(f"{path} is not a {SESSION_KIND} session")
    if state["kind"] in OLD_KINDS:
        keys = payload["keys"]
        cells = keys[0] if isinstance(keys, list) and keys and isinstance(keys[0], torch.Tensor) else None
        if cells is None:
            raise ChatError(f"{path}: damaged session state (keys)")
        state = {**state, "kind": SESSION_KIND, "model": None, "cache_type": cache_type_name(cells.dtype)}
    for name, kind in {**STATE_FIELDS, **NEW_FIELDS}.items():
        if not isinstance(state.get(name), kind) or (kind is int and isinstance(state[name], bool)):
            raise ChatError(f"{path}: damaged session state ({name})")
    counts = [state[n] for n in ("n_keep", "shifts", "discarded", "dropped_exchanges")]
    if min(counts) < 0 or not _stats_fit(state["stats"]):
        raise ChatError(f"{path}: damaged session state (counts)")
    if "sampling" in state and not isinstance(state["sampling"], dict):
        raise ChatError(f"{path}: damaged session state (sampling)")
    return state


def _stats_fit(stats: dict[str, Any]) -> bool:
    """Every total a count or a time of at least 0 (JSON's NaN and a hand-made -50 are not)."""
    return all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        for v in stats.values()
    )


def check_positions(n: int, state: dict[str, Any], path: str | Path) -> None:
    """The kept count and every exchange's cells must lie among the ``n`` saved cells."""
    if n > state["n_ctx"] or not 0 <= state["n_keep"] <= n or state["n_keep"] >= state["n_ctx"] - 1:
        raise ChatError(f"{path}: {n} cells, {state['n_keep']} kept: no cache of {state['n_ctx']} holds that")
    for e in state["exchanges"]:
        texts = isinstance(e, dict) and isinstance(e.get("user"), str) and isinstance(e.get("reply", ""), str)
        if not texts:
            raise ChatError(f"{path}: damaged session state (exchanges)")
        for p in (e.get("start"), e.get("reply_start")):
            if p is not None and (not isinstance(p, int) or not 0 <= p <= n):
                raise ChatError(f"{path}: an exchange points outside the saved cells")


@dataclass(frozen=True)
class SavedSettings:
    """What a session was made with, as ``selfextend chat``'s flags name it. ``model`` is None for a file
    from before sessions recorded it; ``keep`` is the flag's value (None: the system prompt), ``n_keep``
    the cells that kept; ``sampling``: the saved sampling settings (``SamplingParams`` fields)."""

    model: str | None
    dtype: str
    weights: str
    group_size: int | None
    window: int | None
    ctx: int
    keep: int | None
    n_keep: int
    system: str | None
    cache_type: str
    sampling: dict[str, Any]


def saved_settings(path: str | Path) -> SavedSettings:
    """The settings of the session saved in ``path``, read without a model; :class:`ChatError` for a file
    that is not an intact session."""
    try:
        payload = promptcache.peek(path)
    except promptcache.PromptCacheError as e:
        raise ChatError(str(e)) from None
    state = session_state(payload, path)
    cache = json.loads(payload["settings"])
    se = cache.get("self_extend")
    if not (se is None or (isinstance(se, list) and len(se) == 2 and all(type(x) is int for x in se))):
        raise ChatError(f"{path}: damaged settings (self_extend)")
    dtype, weights = cache.get("dtype"), cache.get("weights")
    if not (isinstance(dtype, str) and dtype.startswith("torch.") and isinstance(weights, str)):
        raise ChatError(f"{path}: damaged settings (dtype, weights)")
    sampling = dict(state.get("sampling") or {})
    if isinstance(sampling.get("logit_bias"), dict):  # JSON wrote its token ids as text
        sampling["logit_bias"] = {_id(k): v for k, v in sampling["logit_bias"].items()}
    return SavedSettings(
        model=state["model"],
        dtype=dtype.removeprefix("torch."),
        weights=weights,
        group_size=se[0] if se else None,
        window=se[1] if se else None,
        ctx=state["n_ctx"],
        keep=state["keep"],
        n_keep=state["n_keep"],
        system=state["system"],
        cache_type=state["cache_type"],
        sampling=sampling,
    )


def _id(key: str) -> int | str:
    """A token id JSON wrote as an object key, back as the integer (anything else as it is, refused later)."""
    return int(key) if key.isdigit() else key
