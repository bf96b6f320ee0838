"""The memory a sweep's longest forward needs, checked against what the machine has before the sweep starts.

A ``ppl`` or ``passkey`` length past what the machine holds used to start, load the model, and be killed
by the kernel's OOM killer in the middle of the forward (exit status 137, nothing said). A forward of L
tokens holds a few (L, hidden) and (L, intermediate) activations at once, and a passkey prompt its (L)
cells of keys and values; both are known from the config before anything runs. The activations' count is
measured, not derived: ``ppl`` on SmolLM2-135M in float32 peaked at 1.58 GB resident at 16k tokens and
2.18 GB at 32k on the 2-core Xeon (``/usr/bin/time -v``), 36.6 KB a token, 5 hidden rows and 4
intermediate rows of float32 (36.1 KB). Fewer than 2 and 2 cannot hold a layer's input and its MLP's two
projections, so a length whose floor is past the memory available is refused, and one whose measured
estimate is past it is warned of.

Why ours: nothing in torch or accelerate estimates a forward's activations (accelerate's
``compute_module_sizes`` counts weights); psutil (accelerate's dependency) says what is available.
Only the CPU is checked: a model on a GPU allocates there, and torch says when it cannot.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from selfextend.core.validate import ValidationError
from selfextend.evaluation.methods import Method
from selfextend.evaluation.nll import dense_sliding_mask
from selfextend.kv.cache import cache_bytes

FLOOR_ROWS = (2, 2)  # (hidden, intermediate) rows a token's activations take at the least
SEEN_ROWS = (5, 4)  # as measured on SmolLM2-135M (above)


def _width(model: nn.Module) -> int:
    """Bytes of one value of the model's dtype (its activations' and its cells')."""
    return torch.empty(0, dtype=getattr(model, "dtype", torch.float32)).element_size()


def forward_bytes(model: nn.Module, length: int, rows: tuple[int, int], cells: bool) -> int:
    """Bytes one forward over ``length`` tokens holds beyond the weights: ``rows`` of hidden and
    intermediate activations a token (none where the model is scored in chunks: sliding layers), and with
    ``cells`` a passkey cache's keys and values for every token."""
    config = model.config.get_text_config()
    width = _width(model)
    chunked = dense_sliding_mask(model)
    per_token = 0 if chunked else rows[0] * config.hidden_size + rows[1] * config.intermediate_size
    held = length * per_token * width
    if cells:
        held += cache_bytes(config, length, bytes_per_value=width)
    return held


def available_bytes() -> int:
    """Memory the system can give now without swapping (psutil's ``available``)."""
    import psutil

    return psutil.virtual_memory().available


def check_memory(
    model: nn.Module,
    runs: Iterable[tuple[int, Method]],
    cells: bool,
    available: int | None = None,
) -> str | None:
    """Refuse (:class:`~selfextend.core.validate.ValidationError`) the longest of ``runs`` ((length, method)
    pairs; a shift method streams through its own ``ctx``: only its cells are checked) where even its floor
    is past the memory ``available`` (now, if None); a warning where the measured estimate is; None where
    it fits or the model is not on the CPU."""
    if next(model.parameters()).device.type != "cpu":
        return None
    runs = list(runs)
    available = available_bytes() if available is None else available
    _check_shift_cells(model, [m for _, m in runs if m.kind == "shift"], available)
    lengths = [n for n, method in runs if method.kind != "shift"]
    if not lengths:
        return None
    longest = max(lengths)
    floor = forward_bytes(model, longest, FLOOR_ROWS, cells)
    if floor > available:
        raise ValidationError(
            "lengths",
            f"up to {longest:,} tokens need at least {floor / 1e9:.1f} GB for one forward beside the "
            f"weights, and {available / 1e9:.1f} GB is available: leave out the longest",
        )
    seen = forward_bytes(model, longest, SEEN_ROWS, cells)
    if seen > available:
        return (
            f"{longest:,} tokens may not fit: a forward of them needs about {seen / 1e9:.1f} GB beside the "
            f"weights, {available / 1e9:.1f} GB is available (the kernel ends a process out of memory unsaid)"
        )
    return None


def _check_shift_cells(model: nn.Module, shifts: list[Method], available: int) -> None:
    """ValidationError where a shift method's cache, allocated and zeroed whole before its first token
    (``ctx`` cells of every layer), is past the memory ``available``: refused with its sizes before the
    allocation fails or the zeroing runs the machine out of memory."""
    if not shifts:
        return
    ctx = max(int(m.params["ctx"]) for m in shifts)
    need = cache_bytes(model.config.get_text_config(), ctx, bytes_per_value=_width(model))
    if need > available:
        raise ValidationError(
            "shift ctx",
            f"{ctx:,} allocates {need / 1e9:.1f} GB of cells at once, and {available / 1e9:.1f} GB is "
            "available: give a smaller ctx",
        )
