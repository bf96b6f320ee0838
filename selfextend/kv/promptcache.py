"""Prompt-cache files: the KV cache after a prompt, saved so that a later run with the same start skips it.

Like llama.cpp's session files. A file records the model's fingerprint and the settings that
change the cached states (dtype, weight format, Self-Extend); a file made under others is refused.
"""

from __future__ import annotations

import hashlib
import json
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from selfextend.core.paths import replacing
from selfextend.kv.cache import ContextShiftCache
from selfextend.models.quantize import weight_format

FORMAT = "selfextend-prompt-cache/4"
READABLE = (FORMAT, "selfextend-prompt-cache/3", "selfextend-prompt-cache/2")
"""/3 stored ``held`` position ranges instead of ``positions``; /2 neither (every layer holds every position).
Both are converted on load."""


class PromptCacheError(ValueError):
    """A prompt-cache file that cannot be used here; one line for users."""


UNHASHED_CONFIG = ("_name_or_path", "transformers_version", "_commit_hash")
"""Config entries that say where or by what a model was loaded, not what it computes: the same GGUF loaded
right after its conversion or later from the cache (or from another cache folder) is one model."""


def fingerprint(model: nn.Module) -> str:
    """A short hash of the model's config (without :data:`UNHASHED_CONFIG`) and a slice of its embedding."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in UNHASHED_CONFIG}
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    table = model.get_input_embeddings()
    emb = (
        table.lookup(torch.arange(64)) if hasattr(table, "lookup") else table.weight[:64]
    )  # blocks or floats
    h.update(emb.detach().float().cpu().numpy().tobytes())
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
    """Write each layer's cells of the first ``len(tokens)`` positions and the last token's ``logits``
    (whole, as :func:`~selfextend.core.paths.replacing` writes: OSError where it cannot be). A sliding-window
    layer has only its window and the kept cells; ``positions`` records each layer's cells' positions,
    increasing. With the logits, a run whose prompt is exactly ``tokens`` starts from the same numbers as the
    run that saved it, instead of recomputing the last token another way. ``extra``: JSON-able state of the
    cache's owner (a chat session), stored with it."""
    positions, keys, values = snapshot(cache, len(tokens))
    payload = {
        "format": FORMAT,
        "settings": json.dumps(settings(model), sort_keys=True),
        "tokens": torch.tensor(tokens, dtype=torch.long),
        "logits": logits.detach().cpu().clone(),
        "positions": positions,
        "keys": keys,
        "values": values,
    }
    if extra is not None:
        payload["extra"] = json.dumps(extra)
    with replacing(path) as tmp:
        torch.save(payload, tmp)


def may_replace(path: str | Path) -> bool:
    """Whether saving to ``path`` loses nothing that is not a saved cache: no file there, or one whose
    header :func:`peek` reads as ours (a text file, a zip, a docx named by mistake is not)."""
    p = Path(path)
    if not p.exists():
        return True
    if not p.is_file():
        return False
    try:
        peek(p, verify=False)  # a damaged cache is still a cache
    except PromptCacheError:
        return False
    return True


def snapshot(cache: ContextShiftCache, n: int) -> tuple[list[torch.Tensor], ...]:
    """(positions, keys, values) per layer: copies of the cells of the first ``n`` positions, in order of
    position (what :meth:`~selfextend.kv.cache.ContextShiftCache.load_prefix` puts back)."""
    positions, keys, values = [], [], []
    for layer in cache.layers:
        pos = layer.positions[: layer.n_used]
        take = torch.nonzero(pos < n).squeeze(1)
        take = take[torch.argsort(pos[take])]
        positions.append(pos[take].cpu())
        keys.append(layer.keys.index_select(-2, take).cpu())
        values.append(layer.values.index_select(-2, take).cpu())
    return positions, keys, values


def _bad(path: str | Path, what: str) -> PromptCacheError:
    return PromptCacheError(f"{path} is a damaged prompt cache or chat session: {what}")


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
    held = payload.get("held")
    if held is not None and not (isinstance(held, list) and all(_is_ranges(h, len(tokens)) for h in held)):
        raise _bad(path, "its held positions are not increasing [lo, hi) ranges within its tokens")
    positions = payload.get("positions")
    if positions is not None and not (
        isinstance(positions, list) and all(_is_positions(p, len(tokens)) for p in positions)
    ):
        raise _bad(path, "its positions are not increasing 1-D integer tensors within its tokens")


def _is_ranges(ranges: object, n: int) -> bool:
    """Whether ``ranges`` is a list of [lo, hi] integer pairs, increasing, apart and within [0, n]."""
    if not isinstance(ranges, list):
        return False
    end = -1
    for r in ranges:
        if not (isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)):
            return False
        if not end < r[0] < r[1] <= n:
            return False
        end = r[1]
    return True


def _is_positions(pos: object, n: int) -> bool:
    """Whether ``pos`` is a 1-D int64 tensor of increasing positions in [0, n)."""
    if not isinstance(pos, torch.Tensor) or pos.dim() != 1 or pos.dtype != torch.long:
        return False
    return len(pos) == 0 or (int(pos[0]) >= 0 and int(pos[-1]) < n and bool((pos[1:] > pos[:-1]).all()))


def positions(payload: dict[str, Any]) -> list[torch.Tensor]:
    """Per layer, the positions of the cells a (checked) payload holds, in order (older formats converted)."""
    if "positions" in payload:
        return payload["positions"]
    n = payload["tokens"].shape[0]
    if "held" not in payload:
        return [torch.arange(n) for _ in payload["keys"]]
    return [
        torch.cat([torch.arange(lo, hi) for lo, hi in h]) if h else torch.zeros(0, dtype=torch.long)
        for h in payload["held"]
    ]


def _check_shapes(path: str | Path, payload: dict, cache: ContextShiftCache) -> None:
    """One (B, Hkv, n, D) tensor per layer of ``cache`` for each of keys and values, n the positions held,
    of the cells' element type (bf16 cells loaded into f32 ones give numbers no f32 run gives)."""
    layers = cache.layers
    for name in ("keys", "values"):
        states = payload[name]
        if not isinstance(states, list) or len(states) != len(layers):
            count = len(states) if isinstance(states, list) else "?"
            raise _bad(path, f"{name} for {count} layers, the model has {len(layers)}")
    layers_pos = positions(payload)
    if len(layers_pos) != len(layers):
        raise _bad(path, f"positions for {len(layers_pos)} layers, the model has {len(layers)}")
    for name in ("keys", "values"):
        for i, (t, layer, pos) in enumerate(zip(payload[name], layers, layers_pos, strict=True)):
            want = (*layer.keys.shape[:2], len(pos), layer.keys.shape[-1])
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise _bad(path, f"layer {i} {name} have shape {got}, expected {want}")
    saved, ours = (str(t.dtype).removeprefix("torch.") for t in (payload["keys"][0], layers[0].keys))
    if saved != ours:
        raise PromptCacheError(f"{path} holds {saved} cells; this cache's are {ours} (--cache-type)")


def load(
    path: str | Path, model: nn.Module, cache: ContextShiftCache, prompt: list[int]
) -> tuple[list[int], torch.Tensor | None]:
    """Load the longest cached prefix of ``prompt`` into the empty ``cache``.

    Returns the reused tokens, and the saved last-token logits when the prompt is exactly the saved one.
    The prefix is shortened where a sliding-window layer of the file lacks cells its last tokens attend
    (:meth:`~selfextend.kv.cache.ContextShiftCache.loadable`).
    """
    payload = read(path, model, cache)
    if "extra" in payload:  # its owner's state beside the cells: a chat session or a server's slot
        raise PromptCacheError(
            f"{path} is a chat session or a slot file, not a prompt cache: name another file"
        )
    saved = payload["tokens"].tolist()
    n = 0
    limit = min(len(saved), len(prompt), cache.n_ctx - 1)
    while n < limit and saved[n] == prompt[n]:
        n += 1
    whole = n == len(saved) == len(prompt)
    layers_pos = positions(payload)
    n = cache.loadable(layers_pos, n)
    if n:
        cache.load_prefix(payload["keys"], payload["values"], n, layers_pos)
    return prompt[:n], payload["logits"] if whole and n == len(prompt) else None


def read(path: str | Path, model: nn.Module, cache: ContextShiftCache) -> dict[str, Any]:
    """The file's contents, once it is known to be ours, intact, shaped for ``cache``'s layers and made
    with this model and these settings; PromptCacheError if not."""
    payload = peek(path)
    check(path, payload, model, cache)
    return payload


def check(path: str | Path, payload: dict[str, Any], model: nn.Module, cache: ContextShiftCache) -> None:
    """PromptCacheError unless the (peeked) payload was made with ``model`` and its settings and is shaped
    for ``cache``'s layers; the error names each differing setting's value in the file and now."""
    ours, theirs = settings(model), json.loads(payload["settings"])
    if ours != theirs:
        diff = ", ".join(
            f"{describe(k, theirs.get(k))} in the file, {describe(k, v)} now"
            for k, v in ours.items()
            if theirs.get(k) != v
        )
        raise PromptCacheError(f"{path} was made with another model or settings ({diff})")
    _check_shapes(path, payload, cache)
    _check_values(path, payload, model)


def _check_values(path: str | Path, payload: dict, model: nn.Module) -> None:
    """Token ids the embedding table has rows for (a later turn may feed them again), logits over the model's
    vocabulary with no NaN, cells that are numbers (a NaN key reads as a reply of nothing)."""
    rows = model.get_input_embeddings().num_embeddings
    tokens = payload["tokens"]
    if len(tokens) and not (int(tokens.min()) >= 0 and int(tokens.max()) < rows):
        raise _bad(path, f"its token ids run {int(tokens.min())}..{int(tokens.max())}, the model has {rows}")
    logits = payload["logits"]
    if len(logits) and (len(logits) < rows or bool(logits.isnan().any())):
        raise _bad(path, f"its logits are not {rows} numbers (NaN, or {len(logits)} of them)")
    for name in ("keys", "values"):
        for i, t in enumerate(payload[name]):
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise _bad(path, f"layer {i} {name} hold values that are not numbers")


def describe(name: str, value: object) -> str:
    """A :func:`settings` entry as the flags that set it (``-g 4 -w 64``, ``--weights int8``)."""
    if name == "self_extend":
        if isinstance(value, list) and len(value) == 2:
            return "-g {} -w {}".format(*value)
        return "no Self-Extend" if value is None else f"-g/-w {value}"
    if name == "model":
        return f"model fingerprint {value}"
    if name == "dtype":
        return f"--dtype {str(value).removeprefix('torch.')}"
    return f"--{name.replace('_', '-')} {value}"


def _verify(path: Path) -> None:
    """PromptCacheError if a byte changed since the file was written. ``torch.save`` writes a zip whose
    entries carry CRC-32s that ``torch.load`` never checks (a flipped bit inside a key loads as a number
    no run made); the standard library's ``testzip`` reads each entry against its CRC. A file that is not
    a zip is left to ``torch.load`` to name."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return
    if bad is not None:
        entry = bad.split("/", 1)[-1]  # after the zip's folder, which torch names after the first file
        raise _bad(path, f"its bytes no longer match the checksums written with them (in its entry {entry})")


def peek(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """The file's contents once it is known to be ours and intact (its checksums too, unless ``verify`` is
    false), before any model is there: what a resumed session reads its settings from (:func:`read` then
    checks them against the model)."""
    if not Path(path).exists():
        raise PromptCacheError(f"no file {path}")
    if Path(path).is_dir():
        raise PromptCacheError(f"{path} is a folder, not a selfextend prompt cache or chat session")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:  # a file it may not read: said as such, not as a file of another kind
        raise PromptCacheError(f"cannot read {path}: {e.strerror or type(e).__name__}") from None
    if not head:
        raise PromptCacheError(f"{path} is empty, not a selfextend prompt cache or chat session")
    if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):  # torch's zip without its end: cut short
        raise PromptCacheError(f"{path} is cut short or damaged (its end is missing: was its write stopped?)")
    if verify:
        _verify(Path(path))
    try:
        with warnings.catch_warnings():  # torch's own about a file of another kind: said below, in one line
            warnings.simplefilter("ignore")
            payload = torch.load(Path(path), map_location="cpu", weights_only=True)
    except Exception:  # torch raises many types for a file that is not its own
        raise PromptCacheError(f"{path} is not a selfextend prompt cache or chat session") from None
    if not isinstance(payload, dict) or payload.get("format") not in READABLE:
        raise PromptCacheError(f"{path} is not a {FORMAT} file (another version or another program)")
    _check_payload(path, payload)
    return payload
