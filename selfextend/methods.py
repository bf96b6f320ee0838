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

from torch import nn

from selfextend.patch import self_extend, trained_window
from selfextend.rope import find_rotary_embedding

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
    """A method spec that cannot be parsed; one line for users."""


@dataclass(frozen=True)
class Method:
    """A parsed method spec."""

    kind: str
    params: dict[str, float | int] = field(default_factory=dict)

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
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise MethodError(f"unknown method '{spec}': {USAGE}")
    params: dict[str, float | int] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in KINDS[kind]:
            raise MethodError(
                f"bad parameter '{part}' in method '{spec}': {kind} takes {sorted(KINDS[kind]) or 'none'}"
            )
        try:
            params[key] = KINDS[kind][key](value.strip())
        except ValueError:
            raise MethodError(f"bad value '{value}' for {key} in method '{spec}'") from None
    missing = REQUIRED.get(kind, set()) - params.keys()
    if missing:
        raise MethodError(f"method '{spec}' needs {', '.join(sorted(missing))}")
    if kind == "shift" and ("G" in params) != ("W" in params):
        raise MethodError(f"method '{spec}': Self-Extend inside shift needs both G and W")
    if kind in ("ntk", "yarn") and params["factor"] <= 1:
        raise MethodError(f"method '{spec}': factor must be > 1")
    if kind == "shift" and not 0 <= params.get("keep", 0) < params["ctx"] - 1:
        raise MethodError(f"method '{spec}': need 0 <= keep < ctx - 1")
    return Method(kind, params)


def _parent_of(model: nn.Module, child: nn.Module) -> tuple[nn.Module, str]:
    for parent in model.modules():
        for name, module in parent.named_children():
            if module is child:
                return parent, name
    raise ValueError("rotary embedding not found among the model's modules")


@contextmanager
def rope_scaling(model: nn.Module, rope_type: str, factor: float) -> Iterator[nn.Module]:
    """Swap in a rotary embedding of another RoPE type (``dynamic`` or ``yarn``) for the block."""
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
