"""Where the library may write: the cache root (converted GGUFs, compiled kernels, inductor's code), and
how a file is replaced whole (written under another name beside it first).

Here, at the bottom of the import order, because the native kernels' build (:mod:`selfextend.native`)
and the model loading (:mod:`selfextend.models`) both write under it.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
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


def cannot_replace(path: str | Path) -> OSError | None:
    """Why :func:`replacing` would refuse ``path`` (the OSError it raises, ``strerror`` in words), or None:
    a folder's name (ending in ``/``), a missing folder, one that may not be written in, a read-only file
    (its owner's write bit off: as root ``os.access`` passes every file). Asked again where the file is
    written: a chat's session file is asked at the start too, not only after the conversation."""
    if str(path).endswith(("/", os.sep)):
        return IsADirectoryError(errno.EISDIR, "a file's name is needed, not a folder's", str(path))
    target = Path(os.path.realpath(Path(path).expanduser()))
    folder = target.parent
    if not folder.is_dir():
        return FileNotFoundError(errno.ENOENT, f"no folder {folder}", str(path))
    if target.exists():
        if not target.stat().st_mode & stat.S_IWUSR or not os.access(target, os.W_OK):
            return PermissionError(errno.EACCES, "the file is read-only", str(path))
    if not os.access(folder, os.W_OK | os.X_OK):
        return PermissionError(errno.EACCES, f"no permission to write in {folder}", str(path))
    return None


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """``with replacing(path) as tmp:`` write ``tmp``; then it replaces ``path`` whole (``os.replace``: a
    reader never sees half a file), as an overwrite in place would leave it: a symlink's target written (the
    link kept), the old file's permission bits kept (a private session stays private). What
    :func:`cannot_replace` finds is raised before anything is written; ``tmp`` never stays behind."""
    problem = cannot_replace(path)
    if problem is not None:
        raise problem
    target = Path(os.path.realpath(Path(path).expanduser()))
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
    tmp = temporary_beside(target)
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
