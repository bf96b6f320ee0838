"""``selfextend cache list|clear``: what the converted-GGUF cache holds, and freeing it."""

from __future__ import annotations

import click


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@click.group()
def cache() -> None:
    """Show or free the cache of converted GGUFs: $SELFEXTEND_CACHE if set, else $XDG_CACHE_HOME/selfextend,
    else ~/.cache/selfextend.

    Each GGUF is converted once per weight form (int8, or a dtype) into the weights a run uses;
    later loads read that. Clearing it only costs a conversion (seconds) on the next load.
    """


@cache.command("list")
def list_() -> None:
    """One line per entry: size, form (stale: from an older version, never read; not selfextend's: left
    alone by clear), source GGUF."""
    from selfextend.models import cache_entries, cache_root
    from selfextend.models.diskcache import FOREIGN

    entries = cache_entries()
    root = cache_root()
    click.echo(f"cache: {root}")
    if not entries:
        click.echo("(empty)" if root.exists() else "(no such folder yet: nothing cached)")
        return
    for e in entries:
        form = (
            "assembled GGUF"
            if e.form is None
            else e.form + ("" if e.usable or e.form == FOREIGN else " (stale)")
        )
        click.echo(f"{_mb(e.bytes):>12}  {form:<22}  {e.source}")
    click.echo(f"{_mb(sum(e.bytes for e in entries)):>12}  total")


@cache.command()
def clear() -> None:
    """Delete every entry selfextend wrote (conversions, assembled GGUFs, compiled kernels); they are rebuilt
    when next needed. Files it did not write are left where they are."""
    from selfextend.models import cache_entries, cache_root, clear_cache
    from selfextend.models.diskcache import FOREIGN

    root = cache_root()
    if not root.exists():
        click.echo(f"nothing to free: no folder {root} (nothing cached yet)")
        return
    freed = clear_cache()
    click.echo(f"freed {_mb(freed)} in {root}")
    kept = [e.path.name for e in cache_entries() if e.form == FOREIGN]
    if kept:
        click.echo(f"left {len(kept)} not written by selfextend: {', '.join(kept)}")
