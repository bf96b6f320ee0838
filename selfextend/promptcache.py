"""Prompt-cache files: the KV cache after a prompt, saved so that a later run with the same start skips it.

Like llama.cpp's session files. A file records the model's fingerprint and the settings that
change the cached states (dtype, weight format, Self-Extend); a file made under others is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from selfextend.cache import ContextShiftCache
from selfextend.quantize import weight_format

FORMAT = "selfextend-prompt-cache/2"


class PromptCacheError(ValueError):
    """A prompt-cache file that cannot be used here; one line for users."""


def fingerprint(model: nn.Module) -> str:
    """A short hash of the model's config and a slice of its embedding weights."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    emb = model.get_input_embeddings().weight
    h.update(emb[:64].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def settings(model: nn.Module) -> dict[str, Any]:
    """What the cached states depend on besides the tokens."""
    se = [m.self_extend for m in model.modules() if hasattr(m, "self_extend")]
    return {
        "model": fingerprint(model),
        "dtype": str(next(model.parameters()).dtype),
        "self_extend": [se[0].group_size, se[0].window] if se else None,
        "weights": weight_format(model),
    }


def save(
    path: str | Path,
    model: nn.Module,
    cache: ContextShiftCache,
    tokens: list[int],
    logits: torch.Tensor,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write the first ``len(tokens)`` cells of every layer and the last token's ``logits`` (atomically:
    temp file, then rename). With the logits, a run whose prompt is exactly ``tokens`` starts from the
    same numbers as the run that saved it, instead of recomputing the last token another way.
    ``extra``: JSON-able state of whoever owns the cache (a chat session), stored with it."""
    n = len(tokens)
    payload = {
        "format": FORMAT,
        "settings": json.dumps(settings(model), sort_keys=True),
        "tokens": torch.tensor(tokens, dtype=torch.long),
        "logits": logits.detach().cpu().clone(),
        "keys": [layer.keys[..., :n, :].clone().cpu() for layer in cache.layers],
        "values": [layer.values[..., :n, :].clone().cpu() for layer in cache.layers],
    }
    if extra is not None:
        payload["extra"] = json.dumps(extra)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def _bad(path: str | Path, what: str) -> PromptCacheError:
    return PromptCacheError(f"{path} is a damaged prompt cache: {what}")


def _check_payload(path: str | Path, payload: dict) -> None:
    """Every field a prompt cache needs, with the types it needs; PromptCacheError if not."""
    missing = [k for k in ("settings", "tokens", "logits", "keys", "values") if k not in payload]
    if missing:
        raise _bad(path, f"no {', '.join(missing)}")
    try:
        if not isinstance(json.loads(payload["settings"]), dict):
            raise ValueError
    except (TypeError, ValueError):
        raise _bad(path, "its settings are not a JSON object") from None
    tokens, logits = payload["tokens"], payload["logits"]
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.long:
        raise _bad(path, "its tokens are not a 1-D integer tensor")
    if not isinstance(logits, torch.Tensor) or logits.dim() != 1 or not logits.is_floating_point():
        raise _bad(path, "its logits are not a 1-D float tensor")


def _check_shapes(path: str | Path, payload: dict, cache: ContextShiftCache) -> None:
    """One (B, Hkv, n, D) tensor per layer of ``cache`` for each of keys and values."""
    n, layers = payload["tokens"].shape[0], cache.layers
    for name in ("keys", "values"):
        states = payload[name]
        if not isinstance(states, list) or len(states) != len(layers):
            count = len(states) if isinstance(states, list) else "?"
            raise _bad(path, f"{name} for {count} layers, the model has {len(layers)}")
        for i, (t, layer) in enumerate(zip(states, layers, strict=True)):
            want = (*layer.keys.shape[:2], n, layer.keys.shape[-1])
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise _bad(path, f"layer {i} {name} have shape {got}, expected {want}")


def load(
    path: str | Path, model: nn.Module, cache: ContextShiftCache, prompt: list[int]
) -> tuple[list[int], torch.Tensor | None]:
    """Load the longest cached prefix of ``prompt`` into the empty ``cache``.

    Returns the reused tokens, and the saved last-token logits when the prompt is exactly the saved one.
    """
    payload = read(path, model, cache)
    saved = payload["tokens"].tolist()
    n = 0
    limit = min(len(saved), len(prompt), cache.n_ctx - 1)
    while n < limit and saved[n] == prompt[n]:
        n += 1
    if n:
        cache.load_prefix(
            [k[..., :n, :] for k in payload["keys"]], [v[..., :n, :] for v in payload["values"]]
        )
    whole = n == len(saved) == len(prompt)
    return prompt[:n], payload["logits"] if whole else None


def read(path: str | Path, model: nn.Module, cache: ContextShiftCache) -> dict[str, Any]:
    """The file's contents, once it is known to be ours, intact, shaped for ``cache``'s layers and made
    with this model and these settings; PromptCacheError if not."""
    try:
        payload = torch.load(Path(path), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a file that is not its own
        kind = type(e).__name__
        raise PromptCacheError(f"{path} is not a selfextend prompt cache or chat session ({kind})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise PromptCacheError(f"{path} is not a {FORMAT} file (another version or another program)")
    _check_payload(path, payload)
    ours, theirs = settings(model), json.loads(payload["settings"])
    if ours != theirs:
        diff = ", ".join(
            f"{k}: file {theirs.get(k)} != now {v}" for k, v in ours.items() if theirs.get(k) != v
        )
        raise PromptCacheError(f"{path} was made with another model or settings ({diff})")
    _check_shapes(path, payload, cache)
    return payload
