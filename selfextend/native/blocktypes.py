"""GGUF block types the native kernels hold as stored: each type's facts in one place.

Both the layers holding blocks (:mod:`selfextend.models.blocks`) and the kernels' bindings
(:mod:`selfextend.native.quant`) import them from here, so neither imports the other.
"""

from __future__ import annotations

# gguf.GGMLQuantizationType values of the block formats held as stored
BLOCK_KINDS = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# a type of 32-value blocks -> its 8-row interleaved form (pack8), the kernels' codes in quant.c
INTERLEAVED = {2: 1002, 3: 1003, 8: 1008}


def base_kind(kind: int) -> int:
    """The GGUF type of ``kind``: itself, or the type an interleaved form (:data:`INTERLEAVED`) holds."""
    return kind - 1000 if kind in INTERLEAVED.values() else kind


def block_shape(kind: int) -> tuple[int, int]:
    """(values, bytes) of one block of GGUF type ``kind`` (of a row, for an interleaved form)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(base_kind(kind))]
