"""llama.cpp's own int8 activation blocks, stored for the suite (``tests/data/activation_blocks.npz``, read
by ``tests/test_quant.py::test_activation_blocks_are_llama_cpps``).

Rows of every scale (a zero block of 256, a block of 32 whose float16 scale underflows, a row of quarter
steps, a row whose values fall on ties at half a step) go through llama.cpp's CPU library's
``quantize_row_q8_0``, ``quantize_row_q8_1`` and ``quantize_row_q8_K`` (the x86 build's, AVX2); the rows
and the blocks' bytes are written. The library is built from the llama-cpp-python 0.3.36 sdist's
``vendor/llama.cpp`` (the AMX flags off, for CPUs that advertise AMX without the kernel granting it):

    cmake -S vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \\
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \\
        -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \\
        -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake --build build --target ggml-cpu
    .venv/bin/python experiments/tools/llamacpp_activation_blocks.py build/bin/libggml-cpu.so

(``libggml-cpu.so`` of an installed ``llama_cpp`` package, ``llama_cpp/lib/``, serves as well.)
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# llama.cpp's block: its name, values per block, bytes per block
BLOCKS = (("q8_0", 32, 34), ("q8_1", 32, 36), ("q8_K", 256, 292))
ROWS, COLUMNS = 8, 512


def rows() -> np.ndarray:
    """(ROWS, COLUMNS) float32 of every scale: row 0 starts with a zero block of 256, row 1 with 32 values
    of 1e-9 (a float16 scale that underflows), row 2 in quarter steps, row 3 in blocks of a largest value
    127 (a step of 1) and every k + 1/2 from -14.5 to 15.5 (ties at half a step, rounded to even)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((ROWS, COLUMNS)) * rng.uniform(1e-3, 10, (ROWS, 1))).astype(np.float32)
    x[0, :256], x[1, :32], x[2] = 0, 1e-9, np.round(x[2] * 4) / 4
    x[3] = np.tile([127.0, *(np.arange(-15, 16) + 0.5)], COLUMNS // 32)  # a step of 1: ties at k + 1/2
    return x


def blocks(library: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    """name -> (rows, blocks per row, bytes per block) uint8: llama.cpp's quantize_row_<name> of each row."""
    lib = ctypes.CDLL(str(library))
    out = {}
    for name, per, size in BLOCKS:
        quantize = getattr(lib, f"quantize_row_{name}")
        quantize.argtypes, quantize.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
        made = np.zeros((x.shape[0], x.shape[1] // per, size), np.uint8)
        for row, into in zip(x, made, strict=True):
            quantize(np.ascontiguousarray(row).ctypes.data, into.ctypes.data, x.shape[1])
        out[name] = made
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("library", type=Path, help="llama.cpp's libggml-cpu.so")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "activation_blocks.npz")
    args = parser.parse_args()
    x = rows()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, x=x, **blocks(args.library, x))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
