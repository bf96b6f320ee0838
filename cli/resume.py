"""``selfextend chat --session FILE`` with an existing FILE resumes with the settings the file was made with.

Every setting the cache's contents depend on (model, --dtype, --weights, -g/-w, --ctx, --keep, the system
prompt, --cache-type) comes from the file when the command line leaves it out; one given on the command line
(or from the environment) that differs is refused in one line naming both values, before anything is loaded
or written. The sampling flags are not part of the cache: a chat resumes with the saved ones as its
defaults, and a sampling flag given explicitly replaces its saved value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

if TYPE_CHECKING:
    from selfextend.chat import ChatSession, SavedSettings

EXPLICIT = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT, ParameterSource.PROMPT)
SAMPLING_FLAGS = {"repetition_penalty": "repeat_penalty"}
"""``SamplingParams`` fields whose click parameter has another name."""


class Contradiction(click.ClickException):
    """A flag that contradicts the session file: a usage error (exit 2) that needs no --help hint."""

    exit_code = 2


def model_id(name: str) -> str:
    """The model as recorded in a session file: an alias in lower case, a local path absolute (the chat may
    resume from another folder), anything else (a hub id) as given."""
    from selfextend.models.sources import ALIASES

    text = name.strip()
    if text.lower() in ALIASES:
        return text.lower()
    path = Path(text).expanduser()
    return str(path.resolve()) if path.exists() else text


def _explicit(ctx: click.Context, *names: str) -> bool:
    return any(ctx.get_parameter_source(n) in EXPLICIT for n in names)


def _system(text: str | None) -> str:
    if text is None:
        return "no system prompt"
    return f"--system {text if len(text) <= 40 else text[:39] + '…'!r}"


def _keep(saved: SavedSettings) -> str:
    if saved.keep in (None, -1):
        return f"the default --keep (the system prompt, {saved.n_keep} tokens)"
    return f"--keep {saved.keep}"


def _refuse(given: str, saved: str) -> Contradiction:
    return Contradiction(
        f"{given} contradicts the session file (saved with {saved}); leave it out to resume, "
        "or start a new session file"
    )


def resume(path: str, given: dict[str, Any], ctx: click.Context | None = None) -> dict[str, Any]:
    """``given`` (model, dtype, weights, group_size, window, ctx, keep, system, cache_type, sampling: the
    chat command's values) with what the session file at ``path`` records in place of every value the
    command line left out (the same keys in the same order). :class:`Contradiction` for an explicit value
    that differs from the file's."""
    from selfextend.chat import saved_settings
    from selfextend.generation.sampling import SamplingParams
    from selfextend.kv.promptcache import describe
    from selfextend.models.diskcache import parse_dtype

    ctx = ctx or click.get_current_context()
    saved = saved_settings(path)
    out = dict(given)

    def take(name: str, value: Any, flag: str, shown: str, same: Callable[[Any], bool] | None = None) -> None:
        """The saved ``value`` for ``name``, unless given explicitly: then it must be the same."""
        if _explicit(ctx, name) and not (same(given[name]) if same else given[name] == value):
            raise _refuse(f"{flag} {given[name]}", shown)
        out[name] = value

    if saved.model is not None:
        take("model", saved.model, "-m", f"-m {saved.model}", lambda m: model_id(m) == saved.model)
    if not (_explicit(ctx, "dtype") and given["dtype"] == "auto"):  # auto: the model's own, checked on load
        same_dtype = lambda d: parse_dtype(d) == parse_dtype(saved.dtype)  # noqa: E731
        take("dtype", saved.dtype, "--dtype", f"--dtype {saved.dtype}", same_dtype)
    if _explicit(ctx, "weights") and given["weights"] == "auto":  # auto: whatever fits, so the file's
        out["weights"] = saved.weights
    else:
        take("weights", saved.weights, "--weights", f"--weights {saved.weights}")
    se = describe("self_extend", None if saved.group_size is None else [saved.group_size, saved.window])
    take("group_size", saved.group_size, "-g", se)
    take("window", saved.window, "-w", se)
    take("ctx", saved.ctx, "--ctx", f"--ctx {saved.ctx}")
    if _explicit(ctx, "keep") and given["keep"] not in (saved.keep, saved.n_keep):
        if not (given["keep"] == -1 and saved.keep is None):  # -1 and the default both keep the system part
            raise _refuse(f"--keep {given['keep']}", _keep(saved))
    out["keep"] = given["keep"] if _explicit(ctx, "keep") else saved.keep
    if _explicit(ctx, "system", "system_file") and (given["system"] or None) != (saved.system or None):
        raise _refuse(_system(given["system"]), _system(saved.system))
    out["system"] = saved.system
    take("cache_type", saved.cache_type, "--cache-type", f"--cache-type {saved.cache_type}")
    kept = {
        f.name: saved.sampling[f.name]
        for f in fields(SamplingParams)
        if f.name in saved.sampling and not _explicit(ctx, SAMPLING_FLAGS.get(f.name, f.name))
    }
    try:
        sampling = SamplingParams(**{**vars(given["sampling"]), **kept})
        sampling.validate()
    except ValueError as e:  # a value from the file (a hand edit), which no flag of this run gave
        raise Contradiction(f"{path}: saved sampling settings: {e}") from None
    out["sampling"] = sampling
    return out


def in_use(session: ChatSession) -> str:
    """The settings a chat runs with, read from its model and cache, as the flags that set them: what a
    resumed chat says it resumed with."""
    from selfextend.chat.sessionfile import cache_type_name
    from selfextend.kv import promptcache

    cache = promptcache.settings(session.model)
    flags = [f"-m {session.model_name}"] if session.model_name else []
    flags += [promptcache.describe(k, cache[k]) for k in ("dtype", "weights", "self_extend")]
    flags += [f"--ctx {session.n_ctx}", f"{session.n_keep} kept"]
    flags.append(f"--cache-type {cache_type_name(session.cache.layers[0].keys.dtype)}")
    return ", ".join(flags)
