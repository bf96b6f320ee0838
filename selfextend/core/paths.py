"""Where the library may write: the cache root (converted GGUFs, compiled kernels, inductor's code), and
the name a file is written under before it replaces the old one whole.

Here, at the bottom of the import order, because the native kernels' build (:mod:`selfextend.native`)
and the model loading (:mod:`selfextend.models`) both write under it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def gguf_file_problem(text: str) -> str | None:
    """Why ``text``, a model named as a ``.gguf`` file, cannot be read as one (None where it is a file): the
    one rule of the library's resolver and the CLI's option check (which runs before torch is imported)."""
    path = Path(text).expanduser()
    if path.is_file():
        return None
    if not path.exists():
        return f"no such file: {text}"
    return f"{text} is {'a directory' if path.is_dir() else 'not a regular file'}, not a GGUF file"


def cache_root() -> Path:
    """Directory holding converted GGUFs: ``$SELFEXTEND_CACHE``, else ``$XDG_CACHE_HOME/selfextend``,
    else ``~/.cache/selfextend``."""
    explicit = os.environ.get("SELFEXTEND_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "selfextend"


def temporary_beside(path: Path) -> Path:
    """A fresh name in ``path``'s folder to write ``path`` under before ``os.replace`` puts it in place (a
    reader never sees half a file): hidden, at most 214 bytes (``path.name + ".tmp"`` passes the 255 a
    file name may hold where ``path``'s is near them)."""
    stem = path.name.encode()[:200].decode(errors="ignore")
    return path.with_name(f".{stem}.{secrets.token_hex(4)}.tmp")
