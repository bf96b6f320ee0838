"""The converted-GGUF cache: each GGUF's run form, config and tokenizer, written once and read by later loads.

One subfolder per GGUF and form, keyed by the GGUF's name, size and mtime. The tokenizer is converted
once per GGUF (``tokenizer/``, shared by its forms) and before any weight, so its peak never adds to
the weights'. Every folder is written into a temporary folder and renamed into place, so an
interrupted conversion never leaves a half-written entry that a later load would trust.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfextend.core.validate import first_line
from selfextend.hf.facts import ModelError, check_rope
from selfextend.models.gguf import GGUFTable, checked_reader, load_gguf, table_and_config
from selfextend.models.gguf_config import parsed_by, tokenizer_reason
from selfextend.models.gguf_families import check_tensors_fit
from selfextend.models.heap import release_free_memory
from selfextend.models.quantize import WEIGHT_FORMATS
from selfextend.models.sources import (
    ASSEMBLED_DIR,
    ASSEMBLED_FILES,
    ModelSource,
    cache_root,
    hub_load,
    resolve_model,
)
from selfextend.models.weights import RunForm, save_run_form

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


# Bump when what is written into a cache entry changes, so older entries are not trusted.
# 4: Q4_0 / Q4_1 blocks held 8 rows interleaved (blocks.pack8); 5: Q8_0 too; 6: embedding tables as blocks;
# 7: the config's head size and RoPE as llama.cpp reads them (models/gguf_rope.py); 8: K-quant blocks
# interleaved where the kernels run that form faster (QuantKernels.interleaves); 9: a tied table held once,
# in its head's interleaved form (weights._tie_head)
_CACHE_FORMAT = 9
_MARKER = "selfextend-cache.json"
RUN_FORM_FILE = "model.safetensors"
_TOKENIZERS = "tokenizer"  # cache subfolder: each GGUF's converted tokenizer, shared by its forms
# cache subfolders that hold compiled code, not conversions (native.build's kernels, torch.compile's)
_BUILDS = {"kernels": "compiled kernels", "inductor": "torch.compile code"}
_STALE_TMP_S = 6 * 3600
FOREIGN = "not selfextend's"  # the form of an entry selfextend did not write: listed, never deleted


_DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "auto": "auto",
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    """A torch dtype from a name (``float32``, ``bf16``, ``half``...), or ``"auto"``; ModelError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ModelError(f"unknown dtype '{dtype}': use float32, bfloat16, float16 or auto")
    return _DTYPES[key]


def _gguf_identity(gguf: Path, form: str) -> dict[str, Any]:
    stat = gguf.stat()
    return {
        "source": str(gguf.resolve()),
        "file": gguf.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "format": _CACHE_FORMAT,
        "form": form,
    }


def _folder_name(gguf: Path, form: str) -> str:
    """``<stem>-<form>-<digest>``: the digest of the GGUF's name, size, mtime, cache format and ``form``."""
    ident = _gguf_identity(gguf, form)
    key = "\0".join(str(ident[k]) for k in ("file", "size", "mtime_ns", "format", "form"))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", gguf.stem)[:80]
    return f"{stem}-{form}-{digest}"


def run_form(weights: str = "float", dtype: torch.dtype | str = torch.float32) -> RunForm:
    """The :class:`~selfextend.models.weights.RunForm` of ``--weights`` and ``--dtype``.

    ``auto`` means float32.
    """
    if weights not in WEIGHT_FORMATS:
        raise ModelError(f"unknown weight format '{weights}': choose one of {', '.join(WEIGHT_FORMATS)}")
    wanted = parse_dtype(dtype)
    return RunForm(weights, torch.float32 if wanted == "auto" else wanted)


def gguf_cache_dir(source: ModelSource | str | os.PathLike[str], form: RunForm | None = None) -> Path:
    """Cache folder for a GGUF (a :class:`ModelSource`, an alias or a path) in a run form (default float32
    weights); it may not exist yet.

    Keyed by file name, size, modification time and form, so a changed file gets a fresh conversion.
    """
    return cache_root() / _folder_name(gguf_of(source), (form or run_form()).name)


def _tokenizer_cache_dir(gguf: Path) -> Path:
    """Cache folder of a GGUF's converted tokenizer (one per GGUF version, whatever the form)."""
    return cache_root() / _TOKENIZERS / _folder_name(gguf, "tokenizer")


def gguf_of(source: ModelSource | str | os.PathLike[str]) -> Path:
    if not isinstance(source, ModelSource):
        source = resolve_model(os.fspath(source))
    if source.kind != "gguf" or source.gguf_path is None:
        raise ModelError(f"model '{source.name}' is not a GGUF, so it has no conversion cache")
    return source.gguf_path


def is_complete(entry: Path) -> bool:
    return all((entry / name).is_file() for name in (_MARKER, "config.json", RUN_FORM_FILE))


def _has_marker(folder: Path) -> bool:
    return (folder / _MARKER).is_file()


def is_cached(source: ModelSource | str | os.PathLike[str], form: RunForm | None = None) -> bool:
    """Whether a GGUF already has a complete converted copy in ``form``, so loading it is quick."""
    return is_complete(gguf_cache_dir(source, form))


def _converted_tokenizer(gguf: Path, reader: GGUFReader) -> Path:
    """The folder holding a GGUF's tokenizer files, converted into the cache the first time.

    transformers builds the fast tokenizer from the GGUF's vocabulary, turning the whole GGUF metadata
    into Python objects (slow and large for a big vocabulary such as Gemma 3's 262k entries), so it is
    done once per GGUF, whichever form is loaded first, and saved for the other forms. It reads the
    metadata through ``reader``, the conversion's open one, instead of parsing the file again (a third of
    Gemma 3's conversion time).
    """
    from transformers import AutoTokenizer

    folder = _tokenizer_cache_dir(gguf)
    if _has_marker(folder):
        return folder
    try:
        with parsed_by(reader):
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # noqa: BLE001 (a token list the merges do not fit: the tokenizers crate's Exception)
        raise ModelError(
            f"cannot read the tokenizer of GGUF '{gguf}': {tokenizer_reason(exc, reader)}"
        ) from exc
    try:
        _write_folder(folder, tokenizer.save_pretrained, gguf, "tokenizer", _has_marker)
    except OSError as exc:
        raise ModelError(f"cannot write the tokenizer cache {folder}: {first_line(exc)}") from exc
    del tokenizer
    gc.collect()  # the converted tokenizer's reference cycles: ~40 MB for Gemma 3's
    return folder


def _convert_gguf(gguf: Path, config: PretrainedConfig, form: RunForm, table: GGUFTable) -> PreTrainedModel:
    """A GGUF's model in its run form, in memory (the slow step)."""
    try:
        return load_gguf(gguf, config, form, table)
    except (OSError, ValueError, KeyError, NotImplementedError, RuntimeError) as exc:
        raise ModelError(f"cannot load GGUF '{gguf}': {first_line(exc)}") from exc


def _write_folder(
    folder: Path, write: Callable[[Path], Any], gguf: Path, form: str, complete: Callable[[Path], bool]
) -> None:
    """Fill a cache folder atomically: ``write`` into a temporary sibling folder, the marker last, then
    a rename (over a folder that is not ``complete``); conversions of an older version of the same
    GGUF are then removed."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(folder.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    try:
        write(tmp)
        # The marker goes in last: a folder without it is never trusted.
        (tmp / _MARKER).write_text(json.dumps(_gguf_identity(gguf, form), indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the entry should read like any other folder
        for written in tmp.iterdir():
            written.chmod(0o644)
        if folder.exists() and not complete(folder):
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not complete(folder):  # not another process finishing the same work first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _remove_superseded(folder, gguf)


def _write_entry(entry: Path, model: PreTrainedModel, tokenizer: Path, gguf: Path, form: RunForm) -> None:
    """Save a converted model into ``entry``: its run form, config and (linked or copied from the
    ``tokenizer`` folder) tokenizer files, so an entry is complete on its own."""

    def write(tmp: Path) -> None:
        save_run_form(model, tmp / RUN_FORM_FILE, form)
        model.config.save_pretrained(tmp)
        for file in tokenizer.iterdir():
            if file.name != _MARKER:
                try:
                    os.link(file, tmp / file.name)
                except OSError:  # a file system without hard links
                    shutil.copy2(file, tmp / file.name)

    _write_folder(entry, write, gguf, form.name, is_complete)


def _remove_stale_tmp(root: Path) -> None:
    """Delete temporary folders left by conversions killed long ago (young ones may still be in use)."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if tmp.is_dir() and now - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _marker(entry: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((entry / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _remove_superseded(entry: Path, gguf: Path) -> None:
    """Delete conversions of an older version of the same GGUF path (the file changed since), in every
    form; other forms of this version stay, and so do entries of other cache formats (an older
    selfextend may still be using them: ``selfextend cache list`` marks them stale)."""
    ident = _marker(entry) or {}
    for other in entry.parent.iterdir():
        if other == entry or other.name.startswith(".") or not other.is_dir():
            continue
        marker = _marker(other)
        if marker is None or marker.get("source") != ident.get("source"):
            continue
        if marker.get("format") == ident.get("format") and (
            marker.get("size"),
            marker.get("mtime_ns"),
        ) != (ident.get("size"), ident.get("mtime_ns")):
            shutil.rmtree(other, ignore_errors=True)


def ensure_converted(source: ModelSource | str | os.PathLike[str], form: RunForm | None = None) -> Path:
    """Return the cache folder of a GGUF in ``form`` (default float32), converting and saving it first
    if needed (seconds, the first time).

    A GGUF of a model without RoPE is refused (:class:`ModelError`) before anything is written.
    """
    if not isinstance(source, ModelSource):
        source = resolve_model(os.fspath(source))
    form = form or run_form()
    entry = gguf_cache_dir(source, form)
    if not is_complete(entry):
        convert_into(entry, gguf_of(source), form)
    return entry


def convert_into(entry: Path, gguf: Path, form: RunForm) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Convert a GGUF into the cache folder ``entry``; return the model as converted and its tokenizer.

    Every step that reads the GGUF's metadata (the check and the config, which keep the tensor table;
    the tokenizer's conversion, once per GGUF), all through one parse, runs and frees its transient peak
    before the tokenizer is read from its files and kept,
    and all of that before any weight is in memory.
    """
    from transformers import AutoTokenizer

    reader = checked_reader(gguf)
    table, config = table_and_config(gguf, reader)
    check_tensors_fit(table, config, gguf)  # before a model of the metadata's sizes is allocated
    log.info(
        "converting %s into %s weights in the model cache %s: once per file and form, later loads read "
        "the cache (seconds to a minute)",
        gguf.name,
        form.name,
        entry.parent,
    )
    check_rope(config, gguf.name)
    tokenizer_dir = _converted_tokenizer(gguf, reader)
    del reader  # its parsed metadata (Gemma 3's: 0.65 GB), before the weights
    release_free_memory()
    tokenizer = hub_load(ModelSource("dir", str(tokenizer_dir), gguf.name), AutoTokenizer.from_pretrained)
    model = _convert_gguf(gguf, config, form, table)
    try:
        _write_entry(entry, model, tokenizer_dir, gguf, form)
    except OSError as exc:
        raise ModelError(f"cannot write the model cache {entry}: {first_line(exc)}") from exc
    return model, tokenizer


@dataclass(frozen=True)
class CacheEntry:
    """One folder of the cache: a converted GGUF in one form, or an assembled GGUF (``form`` None)."""

    path: Path
    source: str
    form: str | None
    bytes: int
    usable: bool  # complete and in the current format


def cache_entries() -> list[CacheEntry]:
    """What the cache holds, largest first (for ``selfextend cache list``)."""
    root = cache_root()
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_symlink():  # a link to a user's folder: never looked into, never deleted
            found.append(CacheEntry(path, str(path), FOREIGN, 0, False))
            continue
        # a tokenizer file hard-linked into the entry is counted once, in the tokenizer's folder
        files = [p.stat() for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
        size = sum(st.st_size for st in files if st.st_nlink == 1)
        if path.is_dir() and path.name == ASSEMBLED_DIR:
            for p in sorted(path.iterdir()):
                ours = p.name in ASSEMBLED_FILES and p.is_file() and not p.is_symlink()
                found.append(CacheEntry(p, p.name, None if ours else FOREIGN, p.lstat().st_size, ours))
            continue
        if path.is_dir() and path.name == _TOKENIZERS:
            for folder in sorted(p for p in path.iterdir() if not p.name.startswith(".")):
                marker = None if folder.is_symlink() or not folder.is_dir() else _marker(folder)
                if marker is None:  # no marker of ours: a user's file or folder
                    found.append(CacheEntry(folder, str(folder), FOREIGN, folder.lstat().st_size, False))
                    continue
                usable = marker.get("format") == _CACHE_FORMAT
                size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
                found.append(CacheEntry(folder, str(marker.get("source", "?")), "tokenizer", size, usable))
            continue
        marker = _marker(path)
        if marker is None:  # compiled code (rebuilt when deleted), or not ours: never a conversion
            what = _BUILDS.get(path.name, FOREIGN)
            found.append(CacheEntry(path, str(path), what, size, path.name in _BUILDS))
            continue
        usable = is_complete(path) and marker.get("format") == _CACHE_FORMAT
        form = marker.get("form", "float-float32")  # format-1 entries held float32 weights
        found.append(CacheEntry(path, str(marker.get("source", "?")), form, size, usable))
    return sorted(found, key=lambda e: -e.bytes)


def clear_cache() -> int:
    """Delete what selfextend wrote into the cache (it is rebuilt on the next load): conversions, tokenizers,
    assembled GGUFs, compiled code; files and folders it did not write (``$SELFEXTEND_CACHE`` may name a
    shared folder) stay. Returns the bytes freed; OSError naming the first entry that could not be deleted
    (a read-only cache said it freed what it kept), after every other one is."""
    freed, failed = 0, []
    for entry in cache_entries():
        if entry.form == FOREIGN:
            continue
        try:
            if entry.path.is_dir():
                shutil.rmtree(entry.path)
            else:
                entry.path.unlink(missing_ok=True)
            freed += entry.bytes
        except OSError as e:
            failed.append((entry.path, e.strerror or type(e).__name__))
    for holder in (_TOKENIZERS, ASSEMBLED_DIR):  # the folders holding entries, gone when emptied
        with contextlib.suppress(OSError):
            (cache_root() / holder).rmdir()
    if failed:
        (path, why), n = failed[0], len(failed)
        raise OSError(f"could not delete {n} cache entries ({path}: {why}); freed {freed / 2**20:.1f} MiB")
    return freed
