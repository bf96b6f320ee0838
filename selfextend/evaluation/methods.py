"""Context-extension methods to compare, named by a spec string such as ``selfextend:G=4,W=1024``.

- ``plain``: the model as trained.
- ``selfextend:G=..,W=..``: Self-Extend attention.
- ``ntk:factor=..``: dynamic NTK RoPE scaling, transformers' ``dynamic`` rope type.
- ``yarn:factor=..``: YaRN RoPE scaling, transformers' ``yarn`` rope type.
- ``shift:ctx=..,keep=..[,G=..,W=..]``: the text streams through a context-shift cache of
  ``ctx`` tokens keeping the first ``keep``, optionally with Self-Extend on.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from selfextend.core.validate import ValidationError, check_float, check_int, parse_float, parse_int

if TYPE_CHECKING:  # the model code is imported where a method is applied: a bad --method is refused at once
    from torch import nn

KINDS = {
    "plain": {},
    "selfextend": {"G": int, "W": int},
    "ntk": {"factor": float},
    "yarn": {"factor": float},
    "shift": {"ctx": int, "keep": int, "G": int, "W": int},
}
REQUIRED = {"selfextend": {"G", "W"}, "ntk": {"factor"}, "yarn": {"factor"}, "shift": {"ctx"}}
USAGE = "use plain, selfextend:G=..,W=.., ntk:factor=.., yarn:factor=.., shift:ctx=..,keep=.."


class MethodError(ValueError):
    """A method spec that cannot be parsed or used; one line for users."""


def _check_params(kind: str, params: dict[str, float | int], spec: str) -> dict[str, float | int]:
    """Parameters checked (kind, range, finite) and put in the canonical order of ``KINDS[kind]``."""
    if kind not in KINDS:
        raise MethodError(f"unknown method '{spec}': {USAGE}")
    unknown = set(params) - set(KINDS[kind])
    if unknown:
        raise MethodError(
            f"bad parameter {', '.join(sorted(unknown))} in method '{spec}': "
            f"{kind} takes {', '.join(KINDS[kind]) or 'none'}"
        )
    missing = REQUIRED.get(kind, set()) - params.keys()
    if missing:
        raise MethodError(f"method '{spec}' needs {', '.join(sorted(missing))}")
    checked: dict[str, float | int] = {}
    try:
        for key, kind_of in KINDS[kind].items():
            if key not in params:
                continue
            value, label = params[key], f"{key} in method '{spec}'"
            if kind_of is int:
                lo = {"keep": 0, "ctx": 2}.get(key, 1)
                checked[key] = (parse_int if isinstance(value, str) else check_int)(value, label, lo)
            else:  # ntk/yarn factor
                checked[key] = (parse_float if isinstance(value, str) else check_float)(
                    value, label, lo=1.0, lo_open=True
                )
    except ValidationError as e:
        raise MethodError(str(e)) from None
    if kind == "shift" and ("G" in checked) != ("W" in checked):
        raise MethodError(f"method '{spec}': Self-Extend inside shift needs both G and W")
    if kind == "shift" and not checked.get("keep", 0) < checked["ctx"] - 1:
        raise MethodError(f"method '{spec}': need 0 <= keep < ctx - 1")
    if checked.get("keep") == 0:
        del checked["keep"]  # the default: one name for shift:ctx=N and shift:ctx=N,keep=0
    return checked


@dataclass(frozen=True)
class Method:
    """A method spec, checked on construction; parameters kept in one canonical order, so two spellings
    of the same method (``W=..,G=..`` and ``G=..,W=..``) are one method with one name."""

    kind: str
    params: dict[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        kind = str(self.kind).strip().lower()
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "params", _check_params(kind, dict(self.params), kind))

    @property
    def name(self) -> str:
        """The canonical spec string (what JSONL records carry)."""
        if not self.params:
            return self.kind
        return (
            self.kind
            + ":"
            + ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params.items())
        )

    @property
    def length_independent(self) -> bool:
        """True when token t's score does not depend on how many tokens follow it in the input.

        Then one forward over the longest length scores every shorter prefix too. Dynamic NTK
        rescales RoPE by the input length, so it needs a forward per length.
        """
        return self.kind != "ntk"


def parse_method(spec: str) -> Method:
    """``"selfextend:G=4,W=1024"`` -> Method; malformed specs raise MethodError with one line."""
    if not isinstance(spec, str):
        raise MethodError(f"a method spec is text such as 'selfextend:G=4,W=1024', got {type(spec).__name__}")
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise MethodError(f"unknown method '{spec}': {USAGE}")
    params: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in KINDS[kind]:
            raise MethodError(
                f"bad parameter '{part}' in method '{spec}': {kind} takes {', '.join(KINDS[kind]) or 'none'}"
            )
        if key in params:
            raise MethodError(f"parameter {key} given twice in method '{spec}'")
        params[key] = value.strip()
    return Method(kind, _check_params(kind, params, spec))


def unique_methods(methods: list[Method]) -> list[Method]:
    """``methods`` unchanged, or MethodError naming a method given twice (it would be scored twice)."""
    seen: set[str] = set()
    for m in methods:
        if not isinstance(m, Method):
            raise MethodError(f"methods must be Method objects (see parse_method), got {type(m).__name__}")
        if m.name in seen:
            raise MethodError(f"method '{m.name}' given twice (parameters in any order name one method)")
        seen.add(m.name)
    return methods


def parse_methods(specs: list[str] | tuple[str, ...]) -> list[Method]:
    """Several specs (``plain`` when none), refusing a method given twice under any spelling."""
    return unique_methods([parse_method(s) for s in (specs or ("plain",))])


def _parent_of(model: nn.Module, child: nn.Module) -> tuple[nn.Module, str]:
    for parent in model.modules():
        for name, module in parent.named_children():
            if module is child:
                return parent, name
    raise ValueError("rotary embedding not found among the model's modules")


@contextmanager
def rope_scaling(model: nn.Module, rope_type: str, factor: float) -> Iterator[nn.Module]:
    """Swap in a rotary embedding of another RoPE type (``dynamic`` or ``yarn``) for the block."""
    from selfextend.core.rope import find_rotary_embedding
    from selfextend.hf.facts import trained_window

    rotary = find_rotary_embedding(model)
    parent, name = _parent_of(model, rotary)
    config = copy.deepcopy(model.config)
    trained = trained_window(config)
    params = dict(config.rope_parameters)
    params.update(rope_type=rope_type, factor=factor)
    if rope_type == "yarn":
        params["original_max_position_embeddings"] = trained
        config.max_position_embeddings = int(trained * factor)
    config.rope_parameters = params
    scaled = type(rotary)(config=config).to(rotary.inv_freq.device)
    setattr(parent, name, scaled)
    try:
        yield model
    finally:
        setattr(parent, name, rotary)


@contextmanager
def applied(model: nn.Module, method: Method) -> Iterator[nn.Module]:
    """The model changed as ``method`` says for the block (the shift cache is the scorer's part)."""
    from selfextend.hf.patch import self_extend

    p = method.params
    if method.kind == "selfextend" or (method.kind == "shift" and "G" in p):
        with self_extend(model, int(p["G"]), int(p["W"])):
            yield model
    elif method.kind == "ntk":
        with rope_scaling(model, "dynamic", float(p["factor"])):
            yield model
    elif method.kind == "yarn":
        with rope_scaling(model, "yarn", float(p["factor"])):
            yield model
    else:
        yield model
