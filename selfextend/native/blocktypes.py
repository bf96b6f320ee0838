"""GGUF block types the native kernels hold as stored, each described once: :data:`BLOCK_TYPES`.

The Python side reads the table (which GGUF tensors are held as blocks, their shapes, the interleaved
forms); the C side is generated from it (:func:`c_header` writes ``blocktypes.h`` into each build: the
types' codes, block shapes, activation forms, interleaved codes and which family's source holds their
loops) and checked against it when the library loads (``quant_check``: every type in the table has its
loops). Both the layers holding blocks (:mod:`selfextend.models.blocks`) and the kernels' bindings
(:mod:`selfextend.native.quant`) import the facts from here, so neither imports the other.

Adding a type: one :class:`BlockType` entry here, its loops in ``native/<family>.c`` (its case in that
family's ``<family>_loops``), and its test against ``gguf.quants.dequantize`` (tests/test_quant.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

# how a type's product takes the activation rows (the C enum's names): int8 per 32 values with their sum
# (Q8_0-style), per 256 with the sums of 16 (Q8_K-style), or float32 (F16 and BF16: their precision kept)
ACTIVATIONS = {"q8_32": "ACT_Q8_32", "q8_k": "ACT_Q8_K", "f32": "ACT_F32"}
X8_OFFSET = 1000  # an interleaved form's code: its type's code + this


class BlockType(NamedTuple):
    """One GGUF block type the kernels compute: ``name`` and ``code`` as gguf's GGMLQuantizationType,
    ``values`` and ``nbytes`` per block, the C ``family`` whose source (``native/<family>.c``) holds its
    loops, the ``activations`` form its products take (:data:`ACTIVATIONS`), whether an 8-row
    ``interleaved`` form exists (blocks.py's pack8; code + :data:`X8_OFFSET`) and the vector paths its
    loops have beside the portable one (``kernels``)."""

    name: str
    code: int
    values: int
    nbytes: int
    family: str
    activations: str
    interleaved: bool = False
    kernels: tuple[str, ...] = ("avx2",)


BLOCK_TYPES = (
    BlockType("Q4_0", 2, 32, 18, "legacy", "q8_32", interleaved=True),
    BlockType("Q4_1", 3, 32, 20, "legacy", "q8_32", interleaved=True),
    BlockType("Q5_0", 6, 32, 22, "legacy", "q8_32"),
    BlockType("Q5_1", 7, 32, 24, "legacy", "q8_32"),
    BlockType("Q8_0", 8, 32, 34, "legacy", "q8_32", interleaved=True),
    BlockType("Q4_K", 12, 256, 144, "kquant", "q8_k", interleaved=True, kernels=("avx2", "avx512")),
    BlockType("Q5_K", 13, 256, 176, "kquant", "q8_k", interleaved=True, kernels=("avx2", "avx512")),
    BlockType("Q6_K", 14, 256, 210, "kquant", "q8_k", interleaved=True, kernels=("avx2", "avx512")),
    BlockType("F16", 1, 1, 2, "float", "f32"),
    BlockType("BF16", 30, 1, 2, "float", "f32"),
    BlockType("IQ4_NL", 20, 32, 18, "iq", "q8_32"),
    BlockType("IQ4_XS", 23, 256, 136, "iq", "q8_k"),
    BlockType("Q2_K", 10, 256, 84, "klow", "q8_k"),
    BlockType("Q3_K", 11, 256, 110, "klow", "q8_k"),
)
BY_CODE = {t.code: t for t in BLOCK_TYPES}
# gguf.GGMLQuantizationType values of the block formats held as stored
BLOCK_KINDS = {t.code: t.name for t in BLOCK_TYPES}
# a type with an 8-row interleaved form (pack8) -> that form's code in the kernels
INTERLEAVED = {t.code: t.code + X8_OFFSET for t in BLOCK_TYPES if t.interleaved}
FAMILIES = tuple(dict.fromkeys(t.family for t in BLOCK_TYPES))  # the C sources of the loops, in order
HERE = Path(__file__).parent


def base_kind(kind: int) -> int:
    """The GGUF type of ``kind``: itself, or the type an interleaved form (:data:`INTERLEAVED`) holds."""
    return kind - X8_OFFSET if kind in INTERLEAVED.values() else kind


def block_shape(kind: int) -> tuple[int, int]:
    """(values, bytes) of one block of ``kind`` (of a row, for an interleaved form); KeyError for a type
    not in :data:`BLOCK_TYPES`."""
    t = BY_CODE[base_kind(kind)]
    return t.values, t.nbytes


def c_name(t: BlockType) -> str:
    """The C enum's name of ``t``: its own, but F16 and BF16 as ``F16_W`` and ``BF16_W`` (quant.h's
    ``F32`` and ``BF16`` number the activations' element types)."""
    return f"{t.name}_W" if t.family == "float" else t.name


def c_sources() -> tuple[Path, ...]:
    """The quant library's C files: the products' driver (``quant.c``), each family's loops (the K-quants'
    interleaved forms' vector loops in ``kquant_x8.c`` of their own, the 32-value ones' AMX tiles in
    ``amx.c``) and the row lookups in the interleaved forms (``rows.c``)."""
    families = (HERE / f"{family}.c" for family in FAMILIES)
    return (HERE / "quant.c", *families, HERE / "kquant_x8.c", HERE / "amx.c", HERE / "rows.c")


def c_header(types: tuple[BlockType, ...] = BLOCK_TYPES) -> str:
    """``blocktypes.h``: the table (``types``) as the C sources read it (codes, shapes, activation forms,
    the interleaved codes, each family's loops and the type -> family dispatch)."""
    x8 = [(t, t.code + X8_OFFSET) for t in types if t.interleaved]
    codes = [f"{c_name(t)} = {t.code}" for t in types] + [f"{t.name}X8 = {c}" for t, c in x8]
    families = dict.fromkeys(t.family for t in types)

    def switch(signature: str, pick: Callable[[BlockType], object], default: object) -> str:
        """A C function ``signature`` returning ``pick(t)`` for each type's codes (its form's too)."""
        by_value: dict[str, list[str]] = {}
        for t in types:
            by_value.setdefault(str(pick(t)), []).extend([c_name(t)] + [f"{t.name}X8"] * t.interleaved)
        labels = {v: " ".join(f"case {n}:" for n in names) for v, names in by_value.items()}
        cases = " ".join(f"{label} return {v};" for v, label in labels.items())
        return f"static inline {signature} {{\n    switch (type) {{ {cases} }}\n    return {default};\n}}"

    return (
        "\n".join(
            [
                "/* Generated at build from selfextend/native/blocktypes.py (BLOCK_TYPES): do not edit. */",
                f"enum {{ {', '.join(codes)} }};",
                f"#define IS_X8(type) ({' || '.join(f'(type) == {c}' for _, c in x8) or '0'})",
                f"#define BLOCK_CODES {{{', '.join(str(t.code) for t in types)}}}",
                f"#define X8_CODES {{{', '.join(str(c) for _, c in x8)}}}",
                "/* values and bytes per block (of one row), 0 for a type not in the table */",
                switch("long block_values(int type)", lambda t: t.values, 0),
                switch("long block_bytes(int type)", lambda t: t.nbytes, 0),
                "/* how the type's product takes the activation rows */",
                switch("int block_act(int type)", lambda t: ACTIVATIONS[t.activations], -1),
                "/* whether the table gives the type vector loops (quant_check holds the sources to it) */",
                switch("int block_avx2(int type)", lambda t: int("avx2" in t.kernels), 0),
                *(f"int {f}_loops(int type, int portable, loops *L);" for f in families),
                "/* L filled with the loops of `type` (its family's); 0 for a type not in the table */",
                switch(
                    "int find_loops(int type, int portable, loops *L)",
                    lambda t: f"(memset(L, 0, sizeof *L), {t.family}_loops(type, portable, L))",
                    0,
                ),
            ]
        )
        + "\n"
    )
