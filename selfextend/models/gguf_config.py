"""A GGUF's config: transformers' reading of its metadata, completed for the families its tables lack
(:mod:`~selfextend.models.gguf_families`) and given the rotation llama.cpp reads
(:mod:`~selfextend.models.gguf_rope`).

transformers parses the file's metadata again when it builds a GGUF's config or tokenizer
(``load_gguf_checkpoint`` makes a ``gguf.GGUFReader`` of the path at each call): seconds for a large
vocabulary, after the loader has already parsed it. :func:`parsed_by` hands transformers the reader the loader
holds instead: while the config (or a conversion's tokenizer) is built (one at a time, under a lock),
``gguf.GGUFReader`` names a subclass that returns that reader for that one path and parses any other path as
before, and the name is restored after. No public transformers entry point takes an open reader; where one
appears, this replacement goes."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from selfextend.core.validate import first_line
from selfextend.hf.facts import ModelError
from selfextend.models.gguf_rope import GGUFRope, apply_gguf_rope

if TYPE_CHECKING:
    from pathlib import Path

    from gguf import GGUFReader
    from transformers import PretrainedConfig

_READER_LOCK = threading.Lock()


@contextmanager
def parsed_by(reader: GGUFReader | None) -> Iterator[None]:
    """While open, transformers' GGUF reading gets ``reader`` (already parsed) for its file instead of
    parsing the metadata again (seconds for a large vocabulary): ``load_gguf_checkpoint`` makes its
    ``gguf.GGUFReader`` by name at each call, so that name is pointed at a class handing back ``reader``
    for the same path (any other path is parsed as usual)."""
    if reader is None:
        yield
        return
    import gguf

    class Parsed(gguf.GGUFReader):
        def __new__(cls, path: Any, *args: Any, **kwargs: Any) -> Any:
            if os.path.realpath(path) == os.path.realpath(reader.data.filename):
                return reader  # not a Parsed, so __init__ does not run again
            return super().__new__(cls)

    with _READER_LOCK:
        original, gguf.GGUFReader = gguf.GGUFReader, Parsed
        try:
            yield
        finally:
            gguf.GGUFReader = original


def gguf_config(gguf: Path, rope: GGUFRope, reader: GGUFReader | None = None) -> PretrainedConfig:
    """A GGUF's config: transformers' reading of its metadata, with the head size and rotation read as
    llama.cpp reads them (:func:`apply_gguf_rope`; ``rope``: the file's, from its ``GGUFTable``;
    ``reader``: the file's open ``gguf.GGUFReader``, which transformers then reads instead of parsing the
    file a second time)."""
    from transformers import AutoConfig

    from selfextend.models.gguf_families import complete_config, register

    register()  # the families transformers' tables lack (models/gguf_families.py)
    try:
        with parsed_by(reader):
            config = complete_config(AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
    except Exception as exc:  # noqa: BLE001 (metadata of the wrong type fails in huggingface_hub's own types)
        raise ModelError(f"cannot read GGUF '{gguf}': {reason(exc)}") from exc
    apply_gguf_rope(config, rope, gguf.name)
    return config


def reason(exc: BaseException) -> str:
    """An exception's first line, with the next where the first ends in a colon (pydantic's "Class
    validation error for validator 'validate_rope':" says its reason on the line after)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return first_line(exc)


def tokenizer_reason(exc: BaseException, reader: GGUFReader | None) -> str:
    """Why transformers could not build a GGUF's tokenizer: a missing metadata key (its bare ``KeyError``
    names the key's last part: 'tokens') in the file's own name, else :func:`reason`."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

        keys = {v: f"tokenizer.{k}" for k, v in GGUF_TOKENIZER_MAPPING["tokenizer"].items()}
    except (ImportError, KeyError):  # another transformers: the fields named after llama.cpp's keys
        keys = {n: f"tokenizer.ggml.{n}" for n in ("tokens", "scores", "token_type", "merges")}
    name = exc.args[0] if isinstance(exc, KeyError) and exc.args else None
    if not isinstance(name, str) or name not in keys:  # not a tokenizer field (a token a merge names...)
        return reason(exc)
    key = keys[name]
    fields = reader.fields if reader is not None else {}
    if name == "scores" and "tokenizer.ggml.merges" not in fields:  # merges are derived from the scores
        return f"its metadata has no tokenizer.ggml.merges, nor {key} to derive them from"
    return f"its metadata has no {key}"
