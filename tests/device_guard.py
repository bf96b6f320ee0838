"""A CPU stand-in for a second device: catches the tensors a step makes where a GPU run would hold them on
the host, without a GPU.

On a machine without a GPU every tensor is on the CPU, so a ``torch.arange(n)`` made without ``device=``
and then mixed with the model's tensors runs here and fails on ``cuda`` ("Expected all tensors to be on the
same device"). :class:`DeviceGuard` tracks, through a ``TorchFunctionMode``, which tensors belong to the
model's device (its parameters and buffers, tensors made with an explicit ``device=`` or moved with
``.to(...)``/``.cuda()``, and everything computed from them) and which were made on the host by default
(a factory call without ``device=``, ``torch.from_numpy``). An operation that mixes a host tensor of more
than one element with a device tensor is what CUDA refuses: it is recorded with the caller's line.
0-dimensional host tensors pass (CUDA takes them as scalars), and so do indexing a device tensor with
host indices (CUDA copies them over) and ``copy_`` from the host (a host-to-device copy).

Why not the ``meta`` device: a generation loop reads values (the sampled token, positions) that meta
tensors do not have, so it stops at the first ``.item()``; this guard runs the whole loop with real values.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.linspace,
    torch.eye,
}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
CROSSING = INDEXING | {torch.Tensor.copy_}  # what CUDA takes across devices: host indices, a copy
HOST, DEVICE = "host", "device"


def _tag(t: torch.Tensor) -> str | None:
    return getattr(t, "_guard_tag", None)


def _set(value: object, tag: str) -> None:
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor):
            try:
                t._guard_tag = tag
            except (AttributeError, RuntimeError):  # some C-made tensors take no attributes
                pass


class DeviceGuard(TorchFunctionMode):
    """``with DeviceGuard(model) as guard: ...`` then ``guard.mixed``: each host/device mix seen, as
    ``(operation, caller line)``; :meth:`check` raises with them."""

    def __init__(self, *modules: torch.nn.Module, extra: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.mixed: list[tuple[str, str]] = []
        for m in modules:
            _set(list(m.parameters()) + list(m.buffers()), DEVICE)
        _set(list(extra), DEVICE)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES or func is torch.from_numpy:
            _set(out, DEVICE if kwargs.get("device") is not None and func is not torch.from_numpy else HOST)
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in MOVES:
            moved = (
                func is torch.Tensor.cuda
                or "device" in kwargs
                or any(isinstance(a, (str, torch.device)) or isinstance(a, torch.Tensor) for a in args[1:])
            )
            _set(out, DEVICE if moved or _tag(args[0]) == DEVICE else _tag(args[0]) or DEVICE)
            return out
        tags = {_tag(t) for t in inputs if t.dim() > 0 or _tag(t) == DEVICE}
        if DEVICE in tags:
            if HOST in tags and func not in CROSSING:
                self.mixed.append((getattr(func, "__name__", str(func)), _caller()))
            _set(out, DEVICE)
        elif HOST in tags:
            _set(out, HOST)
        return out

    def check(self) -> None:
        """Raise AssertionError naming every host/device mix seen (the first few)."""
        if self.mixed:
            seen = list(dict.fromkeys(self.mixed))
            lines = "\n".join(f"  {op} at {where}" for op, where in seen[:10])
            raise AssertionError(f"{len(seen)} operations mix host and device tensors:\n{lines}")


def _caller() -> str:
    """The innermost frame in selfextend's own code (else the innermost outside torch)."""
    frames = traceback.extract_stack()[:-2]  # without this function and __torch_function__
    ours = [f for f in frames if "/selfextend/" in f.filename and "/tests/" not in f.filename]
    f = (ours or frames)[-1]
    return f"{f.filename.split('/selfextend/')[-1]}:{f.lineno} ({f.line})"
