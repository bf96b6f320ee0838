"""Where the library may write: the cache root (converted GGUFs, compiled kernels, inductor's code).

Here, at the bottom of the import order, because the native kernels' build (:mod:`selfextend.native`)
and the model loading (:mod:`selfextend.models`) both write under it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Directory holding converted GGUFs: ``$SELFEXTEND_CACHE``, else ``$XDG_CACHE_HOME/selfextend``,
    else ``~/.cache/selfextend``."""
    explicit = os.environ.get("SELFEXTEND_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "selfextend"
