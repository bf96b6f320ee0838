"""Every ctypes binding refuses a tensor the C code would misread, with a one-line ValueError: a wrong device
(``meta``: its address is 0, a SIGSEGV before the guard), a dtype other than the one the C reads, a layout
it does not read (not contiguous), a buffer shorter than what it is told to read. Arguments a binding
converts by design (a query made float32 and contiguous, activation rows taken as float32) are faulted only
where a conversion cannot help (meta, short). The decode step's checked calls (``checked=True``: the
wrappers' shape checks skipped, the guard kept) are faulted too.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import pytest
import torch

from selfextend.generation.native_layers import _Dims, _Plan
from selfextend.native.decode import native_kernels
from selfextend.native.quant import quant_kernels

NATIVE, QUANT = native_kernels(), quant_kernels()
pytestmark = pytest.mark.skipif(
    NATIVE is None or QUANT is None, reason="no C compiler here to build the kernels"
)
Q8_0, H, HKV, D, N = 8, 4, 2, 64, 6
FAULTS = ("meta", "dtype", "layout", "short")
OTHER = {torch.float32: torch.float64, torch.bfloat16: torch.float16, torch.int64: torch.int32}


def _q8_0(rows: int = 16, columns: int = 64) -> torch.Tensor:
    import gguf

    values = np.random.default_rng(rows).standard_normal((rows, columns)).astype(np.float32)
    return torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0))


def _rotation() -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(D // 2, dtype=torch.float32) / 7
    return angles.cos(), angles.sin()


def _rope_args() -> dict[str, torch.Tensor]:
    """rope_write's arguments, right in every way."""
    cos, sin = _rotation()
    return {
        "qkv": torch.randn(1, (H + 2 * HKV) * D),
        "keys": torch.zeros(1, HKV, N, D),
        "values": torch.zeros(1, HKV, N, D),
        "cos": cos,
        "sin": sin,
    }


def _layers(args: dict[str, torch.Tensor]) -> object:
    """decode_layers over no layer (the C loop does nothing) or, for a faulted table, one layer of a zeroed
    plan: the guard must refuse before the C reads it."""
    x, cells = args["x"], args["cells"]
    layers = 0 if cells.numel() == 15 and cells.device.type == "cpu" else 1
    dims = _Dims(D, H, HKV, D // H, 2 * D, 0, 0, 1, 0)
    return NATIVE.decode_layers((_Plan * 1)(), layers, dims, cells, x, QUANT.address)


# binding -> (its valid arguments, the call, {fault: the arguments it is tried on})
BINDINGS: dict[str, tuple[Callable[[], dict], Callable[[dict], object], dict[str, tuple[str, ...]]]] = {
    "attention": (
        lambda: {
            "q": torch.randn(1, H, 1, D),
            "k": torch.randn(1, HKV, N, D),
            "v": torch.randn(1, HKV, N, D),
        },
        lambda a: NATIVE(a["q"], a["k"], a["v"], 0.125),
        {"meta": ("q", "k", "v"), "dtype": ("k", "v"), "layout": ("k", "v"), "short": ("q", "k", "v")},
    ),
    "attention checked": (  # the decode step's call: the shapes taken as checked, the guard still there
        lambda: {
            "q": torch.randn(1, H, 1, D),
            "k": torch.randn(1, HKV, N, D),
            "v": torch.randn(1, HKV, N, D),
        },
        lambda a: NATIVE(a["q"], a["k"], a["v"], 0.125, checked=True),
        {"meta": ("q", "k", "v"), "dtype": ("v",), "layout": ("k", "v"), "short": ("v",)},
    ),
    "rope_write": (
        _rope_args,
        lambda a: NATIVE.rope_write(a["qkv"], (H, HKV), (a["cos"], a["sin"]), a["keys"], a["values"], 2),
        {f: ("qkv", "keys", "values", "cos", "sin") for f in FAULTS},
    ),
    "rope_write checked": (
        _rope_args,
        lambda a: NATIVE.rope_write(
            a["qkv"], (H, HKV), (a["cos"], a["sin"]), a["keys"], a["values"], 2, checked=True
        ),
        {
            "meta": ("qkv", "keys", "values", "cos", "sin"),
            "dtype": ("values", "cos", "sin"),
            "layout": ("keys",),
        },
    ),
    "rms_norm_bf16": (
        lambda: {"x": torch.randn(1, D), "weight": torch.randn(D)},
        lambda a: NATIVE.rms_norm_bf16(a["x"], a["weight"], 1e-6),
        {f: ("x", "weight") for f in FAULTS},
    ),
    "rms_norm_add": (
        lambda: {"x": torch.randn(1, D), "y": torch.randn(1, D), "weight": torch.randn(D)},
        lambda a: NATIVE.rms_norm_add(a["x"], a["y"], a["weight"], 1e-6),
        {f: ("x", "y", "weight") for f in FAULTS},
    ),
    "gated_bf16": (
        lambda: {"gate_up": torch.randn(1, 2 * D).bfloat16()},
        lambda a: NATIVE.gated_bf16(a["gate_up"]),
        {f: ("gate_up",) for f in FAULTS},
    ),
    "int8_gemv": (
        lambda: {
            "x": torch.randn(1, D),
            "weight": torch.randint(-9, 9, (16, D), dtype=torch.int8),
            "scale": torch.rand(16).bfloat16(),
        },
        lambda a: NATIVE.int8_gemv(a["x"], a["weight"], a["scale"]),
        {"meta": ("x", "weight", "scale"), "dtype": ("weight", "scale"), "layout": ("weight", "scale")}
        | {"short": ("x", "weight", "scale")},
    ),
    "decode_layers": (
        lambda: {"x": torch.randn(1, D), "cells": torch.zeros(15, dtype=torch.int64)},
        _layers,
        {"meta": ("x", "cells"), "dtype": ("x",), "layout": ("x",), "short": ("x", "cells")},
    ),
    "quant_mm": (
        lambda: {"x": torch.randn(3, 64), "blocks": _q8_0()},
        lambda a: QUANT(a["x"], a["blocks"], Q8_0),
        {"meta": ("x", "blocks"), "dtype": ("blocks",), "layout": ("blocks",), "short": ("x", "blocks")},
    ),
    "quant_dequant_bf16": (
        lambda: {"blocks": _q8_0()},
        lambda a: QUANT.dequantize(a["blocks"], Q8_0, 64),
        {f: ("blocks",) for f in FAULTS},
    ),
    "quant_rows_f32": (
        lambda: {"blocks": _q8_0(), "ids": torch.tensor([0, 15, 3])},
        lambda a: QUANT.rows(a["blocks"], Q8_0, 64, a["ids"]),
        {"meta": ("blocks", "ids"), "dtype": ("blocks",), "layout": ("blocks",), "short": ("blocks",)},
    ),
    "tiled (bf16 engine)": (
        lambda: {"x": torch.randn(3, 64), "blocks": _q8_0()},
        lambda a: QUANT.tiled(a["x"], a["blocks"], Q8_0),  # x goes to torch's product, not to the C
        {"meta": ("blocks",), "dtype": ("blocks",), "layout": ("blocks",), "short": ("x", "blocks")},
    ),
}


def faulted(t: torch.Tensor, fault: str) -> torch.Tensor:
    if fault == "meta":
        return t.to("meta")
    if fault == "dtype":
        return (
            t.view(torch.int8)
            if t.dtype == torch.uint8
            else t.view(torch.uint8)
            if t.dtype == torch.int8
            else (t.to(OTHER[t.dtype]))
        )
    if fault == "layout":  # the same shape and values, every other element
        out = torch.empty(*t.shape, 2, dtype=t.dtype)[..., 0]
        out.copy_(t)
        return out
    return t[..., :-1]


CASES = [
    (name, fault, arg)
    for name, (_, _, faults) in BINDINGS.items()
    for fault in faults
    for arg in faults[fault]
]


@pytest.mark.parametrize("name", sorted(BINDINGS))
def test_the_valid_call_runs(name: str) -> None:
    make, call, _ = BINDINGS[name]
    call(make())


@pytest.mark.parametrize(("name", "fault", "arg"), CASES, ids=[f"{n}-{f}-{a}" for n, f, a in CASES])
def test_a_faulted_argument_is_refused(name: str, fault: str, arg: str) -> None:
    make, call, _ = BINDINGS[name]
    args = make()
    args[arg] = faulted(args[arg], fault)
    with pytest.raises(ValueError) as refused:
        call(args)
    assert "\n" not in str(refused.value)


def test_every_binding_is_faulted_every_way() -> None:
    """Each binding is tried with each fault on at least one argument, and none of the library's ctypes
    functions is left out of :data:`BINDINGS`."""
    assert all(set(f) == set(FAULTS) for name, (_, _, f) in BINDINGS.items() if not name.endswith("checked"))
    bound = {"decode_attention", "rope_write", "rms_norm_bf16", "rms_norm_add", "gated_bf16", "int8_gemv"}
    bound |= {"decode_layers", "quant_mm", "quant_dequant_bf16", "quant_rows_f32", "quant_rows_x8_f32"}
    library = {name for name in bound if hasattr(ctypes.CDLL(str(NATIVE.library)), name)}
    library |= {name for name in bound if hasattr(ctypes.CDLL(str(QUANT.library)), name)}
    assert library == bound


def test_a_row_past_the_table_is_refused_whatever_the_caller_checked() -> None:
    """The row lookup is told the table's rows: an id past them is a ValueError (the C checks it too), for the
    stored rows and the interleaved form."""
    from selfextend.models.blocks import INTERLEAVED, pack8

    blocks = _q8_0()
    for table, kind in ((blocks, Q8_0), (torch.from_numpy(pack8(blocks.numpy(), Q8_0)), INTERLEAVED[Q8_0])):
        QUANT.rows(table, kind, 64, torch.tensor([15]))
        for ids in ([16], [-1], [3, 4_000_000]):
            with pytest.raises(ValueError, match=r"token ids must lie in \[0, 16\)"):
                QUANT.rows(table, kind, 64, torch.tensor(ids))
