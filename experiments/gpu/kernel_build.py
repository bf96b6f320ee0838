"""The fused Triton kernels compiled for a GPU on a machine without one: registers, spills, shared memory.

Triton's interpreter (the suite's kernel tests) runs a kernel's math on the CPU but never compiles it, so a
kernel that cannot compile for a GPU (a tile the hardware's matrix units refuse, a type a lowering lacks),
or that compiles into a program spilling registers to local memory, passes every test and fails or crawls
on the first GPU. Triton's compiler itself needs no GPU: its wheel carries ``ptxas``. This script calls
the real wrappers (:func:`~selfextend.core.fused_prefill.fused_self_extend_prefill`,
:func:`~selfextend.core.fused_decode.fused_decode_attention`, the step's of
:mod:`~selfextend.core.fused_step`) on small CPU tensors with every launch
turned into a compile for a GPU target (``sm_90``: H100/H200 unless ``--arch`` says), so the kernels see
the launches' own arguments, strides and specializations, and reads each program's resources from the
cubin (``cuobjdump``, also in the wheel):

- ``regs``: registers a thread (255 is the most; more spill), ``stack``: bytes a thread spilled to local
  memory (0 wanted: spilled registers are read back from memory in the inner loop);
- ``smem``: shared memory a program (the pipeline's buffered tiles), ``per SM``: programs a multiprocessor
  holds at once by registers, shared memory and warps (H100/H200: 64k registers, 227 KiB, 64 warps;
  A100: 163 KiB);
- ``loops``: machine instructions in each loop's body (one tile's work), read from the disassembly: a
  static proxy for a tile's cost beside ``flash reference``, a plain causal flash-attention loop of the
  same tiles compiled the same way (no Self-Extend, no masks off the diagonal).

It measures no time: the tiles GPUs run fastest are still timed by ``check_fused_prefill.py`` and
``check_fused_decode.py``. By default it builds the launches the code's own tile choices make and the tiles
those scripts time; ``--case NAME`` (repeatable; a name's first words: every case they start) only
those. It exits 1 where a launch fails to compile or asks for more shared memory than the GPU gives a
program (``tests/test_kernel_build.py`` runs a few).

    PYTHONPATH=. python experiments/gpu/kernel_build.py [--arch 90] [--case "prefill bf16 d128" ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter would run the kernels, not compile them
    sys.exit("kernel_build: unset TRITON_INTERPRET (this compiles the kernels, it does not interpret them)")
if importlib.util.find_spec("triton") is None:
    sys.exit("kernel_build: needs triton (make install brings it; pip install triton)")

import torch
import triton
import triton.language as tl

import selfextend.core.fused_prefill as fused_prefill
from selfextend.core.fused_decode import DecodeConfig, fused_decode_attention
from selfextend.core.fused_prefill import BlockConfig, fused_rotate, fused_self_extend_prefill, shared_kib
from selfextend.core.fused_step import KeyWrite, RowNorm, fused_gated, fused_rms_norm, fused_rope_write
from selfextend.core.rope import Rotation

REGISTERS, WARPS = 65536, 64  # a multiprocessor's, Ampere to Hopper
RESOURCES = re.compile(r"Function (\w+):\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")  # an instruction: its address, its text
BRANCH = re.compile(r"BRA\s+(?:`\()?0x([0-9a-f]+)")


@dataclass(frozen=True)
class Built:
    """One kernel compiled for the target: its name, constexprs and the program's resources."""

    name: str
    arch: int
    constexprs: dict
    num_warps: int
    regs: int
    stack: int
    smem: int
    loops: tuple[int, ...]

    def per_sm(self) -> int:
        """Programs one multiprocessor holds at once (registers are given out per warp, 256 at a time)."""
        by_regs = REGISTERS // (-(-self.regs * 32 // 256) * 256 * self.num_warps)
        by_smem = shared_kib(self.arch) * 1024 // (self.smem + 1024)  # the driver reserves 1 KiB
        return min(by_regs, by_smem, WARPS // self.num_warps)


def _bin(name: str) -> str:
    """A tool of the triton wheel's NVIDIA backend (``ptxas``, ``cuobjdump``)."""
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """``cuobjdump``'s report ``flag`` on a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [_bin("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True
        ).stdout


def resources(cubin: bytes) -> dict[str, tuple[int, int, int]]:
    """Registers, stack and static shared memory of each function of a cubin, as ``cuobjdump`` reads them."""
    text = _cuobjdump(cubin, "--dump-resource-usage")
    return {m[1]: (int(m[2]), int(m[3]), int(m[4])) for m in RESOURCES.finditer(text)}


def loops(cubin: bytes) -> tuple[int, ...]:
    """Instructions in the body of each loop of a one-kernel cubin, in code order: from each backward
    branch's target to the branch, in the disassembly (SASS)."""
    at = [(int(m[1], 16), m[2]) for m in SASS.finditer(_cuobjdump(cubin, "-sass"))]
    found = []
    for address, text in at:
        target = BRANCH.search(text)
        if target and int(target[1], 16) < address:
            found.append(sum(int(target[1], 16) <= a <= address for a, _ in at))
    return tuple(found)


@contextmanager
def compiling_for(arch: int, built: list[Built]) -> Iterator[None]:
    """Inside: every Triton kernel launch compiles for ``sm_{arch}`` instead of running, with the arguments
    the launch was given (the specializations a launch on that GPU makes, the tiles the wrappers choose for
    it), appending what it built to ``built``. Reads triton's launcher (``JITFunction.run`` with its
    binder), as 3.9 (the dev extra's) and 3.6 (the GPU machines' of issue 48) have it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime import jit

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    fields = backend.parse_options({}).__dict__

    def run(self, *args, grid, warmup, **kwargs):
        kwargs.setdefault("debug", False)
        kwargs["instrumentation_mode"] = ""
        if "fpsan_homomorphic_casts" in fields:  # triton 3.9's option; 3.6 (a GPU machine's) has none
            kwargs["fpsan_homomorphic_casts"] = False
        binder = jit.create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, options
        )
        source = ASTSource(self, signature, constexprs, attrs)
        kernel = compile(source, target=target, options=options.__dict__)
        regs, stack, _ = resources(kernel.asm["cubin"])[kernel.metadata.name]
        named = {self.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
        built.append(
            Built(
                self.__name__,
                arch,
                named,
                options.num_warps,
                regs,
                stack,
                kernel.metadata.shared,
                loops(kernel.asm["cubin"]),
            )
        )

    saved = jit.JITFunction.run, fused_prefill.compute_capability
    jit.JITFunction.run = run
    fused_prefill.compute_capability = lambda device: arch  # the wrappers pick that GPU's tiles
    try:
        yield
    finally:
        jit.JITFunction.run, fused_prefill.compute_capability = saved


@triton.jit
def flash_reference(
    q_ptr, k_ptr, v_ptr, o_ptr, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr
):
    """Plain causal flash attention (FA2's loop: online softmax in base 2, float32 accumulator), one head
    of contiguous (L, D) rows, no masks off the diagonal: the yardstick ``loops`` and ``regs`` are read
    against. Compiled only, never run (its diagonal block is left out)."""
    m0 = tl.program_id(0) * BLOCK_M
    offs_m, offs_n, offs_d = m0 + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, D)
    q = tl.load(q_ptr + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start in range(0, m0, BLOCK_N):
        k = tl.load(k_ptr + (start + offs_n)[:, None] * D + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (start + offs_n)[:, None] * D + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    tl.store(o_ptr + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))


def reference(dtype: torch.dtype, d: int, config: BlockConfig) -> Callable[[], object]:
    """A launch of :func:`flash_reference` with the prefill's tiles."""
    x = torch.zeros(256, d, dtype=dtype)
    kw = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "D": d}
    run = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return lambda: flash_reference[(2,)](x, x, x, x, 0.1, **kw, **run)


def prefill(
    dtype: torch.dtype, d: int, softcap: float | None, config: BlockConfig | None, band: bool = False
) -> Callable[[], object]:
    """A Self-Extend prefill launch as transformers' layout hands it: 8 query / 2 KV heads, 256 tokens
    (``band``: the split's, the grouped pairs' result given, as cuDNN returns it)."""
    b, h, hkv, n, w = 1, 8, 2, 256, 64
    q, q_g = (torch.zeros(b, n, h, d, dtype=dtype).transpose(1, 2) for _ in range(2))  # (B, H, L, D) views
    k, v = (torch.zeros(b, n, hkv, d, dtype=dtype).transpose(1, 2) for _ in range(2))
    k_g = torch.zeros(b, hkv, n - w, d, dtype=dtype)
    if band:
        out_g = torch.zeros(b, n - w, h, d, dtype=dtype).transpose(1, 2)
        grouped = (w, out_g, torch.zeros(b, h, n - w, 1)[..., 0])
        return lambda: fused_self_extend_prefill(q, k, v, None, None, w, d**-0.5, None, config, grouped)
    return lambda: fused_self_extend_prefill(q, k, v, q_g, k_g, w, d**-0.5, softcap, config)


def rotation(dtype: torch.dtype, d: int) -> Callable[[], object]:
    """A launch of the grouped rotation's kernel on (B, L, H, D) storage seen as (B, H, L, D)."""
    x = torch.zeros(1, 256, 8, d, dtype=dtype).transpose(1, 2)
    return lambda: fused_rotate(x, torch.arange(256), torch.ones(d // 2))


def decode(
    dtype: torch.dtype, d: int, n_rep: int, kind: str, config: DecodeConfig | None
) -> Callable[[], object]:
    """A decode attention launch over 1,024 cells of 8 KV heads: ``kind`` plain, sliding, grouped (keys
    rotated in the kernel) or stored (the grouped keys read as the cache keeps them: the captured step's)."""
    hkv, n = 8, 1024
    q = torch.zeros(1, hkv * n_rep, 1, d, dtype=dtype)
    k, v = (torch.zeros(1, hkv, n, d, dtype=dtype) for _ in range(2))
    positions, pos = torch.arange(n), torch.tensor([n - 1])
    window = 512 if kind == "sliding" else None
    if kind not in ("grouped", "stored"):
        return lambda: fused_decode_attention(q, k, v, positions, pos, d**-0.5, window, config=config)
    keys = Rotation(torch.ones(1, 1, n, d), torch.zeros(1, 1, n, d))
    q_g, stored = q.float(), (torch.zeros_like(k) if kind == "stored" else None)
    return lambda: fused_decode_attention(
        q, k, v, positions, pos, d**-0.5, None, q_g, keys, 256, config, stored=stored
    )


DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def step(kind: str, dtype: torch.dtype, n: int, extra: str = "") -> Callable[[], object]:
    """A launch of the decode step's fused elementwise kernels (selfextend/core/fused_step.py) on the 8B
    shape's rows: ``norm`` (``add``: the residual's add first; ``gemma``: 1 + w), ``gated`` (``gelu``),
    ``rope`` (heads of ``n``, 32/8; ``se``: Self-Extend's grouped query and stored key; ``norms``: Qwen3's
    q/k norms)."""
    if kind == "norm":
        x, w = torch.zeros(1, 1, n, dtype=dtype), torch.ones(n, dtype=dtype)
        norm = RowNorm(w, 1e-5, "gemma" in extra)
        return lambda: fused_rms_norm(x, norm, add=x if "add" in extra else None)
    if kind == "gated":
        y = torch.zeros(1, 1, 2 * n, dtype=dtype)
        return lambda: fused_gated(y, "gelu_pytorch_tanh" if "gelu" in extra else "silu")
    h, hkv, cells = 32, 8, 64
    qkv = torch.zeros((h + 2 * hkv) * n, dtype=dtype)
    keys, values, kept = (torch.zeros(1, hkv, cells, n, dtype=dtype) for _ in range(3))
    turn = Rotation(torch.ones(n), torch.zeros(n))
    table = Rotation(torch.ones(1, 1, cells, n), torch.zeros(1, 1, cells, n))
    grouped = (table, table) if "se" in extra else None
    norms = (RowNorm(torch.ones(n, dtype=dtype), 1e-6, False),) * 2 if "norms" in extra else None
    write = KeyWrite(
        keys, values, torch.zeros(cells, dtype=torch.long), torch.tensor([3]), kept if "se" in extra else None
    )
    return lambda: fused_rope_write(qkv, h, n, turn, torch.tensor([9]), write, grouped, norms)


def defaults() -> dict[str, Callable[[], object]]:
    """The launches the code's own tile choices make: the prefill at head sizes 64-256 in each dtype (80:
    a padded head; softcap: Gemma 2), the decode plain, sliding and grouped at GQA 4 and 1."""
    cases = {}
    for name, dtype in DTYPES.items():
        for d in (64, 80, 128, 256):
            cases[f"prefill {name} d{d}"] = prefill(dtype, d, None, None)
    cases["prefill bf16 d256 softcap"] = prefill(torch.bfloat16, 256, 50.0, None)
    for d in (64, 128, 256):
        cases[f"prefill bf16 d{d} band"] = prefill(torch.bfloat16, d, None, None, band=True)
        cases[f"rotate bf16 d{d}"] = rotation(torch.bfloat16, d)
    cases["rotate f32 d128"] = rotation(torch.float32, 128)
    hopper = fused_prefill.default_config(128, torch.bfloat16)
    cases["flash reference bf16 d128"] = reference(torch.bfloat16, 128, hopper)
    for name in ("bf16", "f32"):
        for kind in ("plain", "sliding", "grouped", "stored"):
            for n_rep in (4, 1):
                cases[f"decode {name} d128 {kind} gqa{n_rep}"] = decode(DTYPES[name], 128, n_rep, kind, None)
    cases["decode bf16 d256 grouped gqa2"] = decode(torch.bfloat16, 256, 2, "grouped", None)
    cases["decode bf16 d256 stored gqa2"] = decode(torch.bfloat16, 256, 2, "stored", None)
    cases["step norm bf16 4096"] = step("norm", torch.bfloat16, 4096)
    cases["step norm bf16 4096 add"] = step("norm", torch.bfloat16, 4096, "add")
    cases["step norm bf16 5376 add gemma"] = step("norm", torch.bfloat16, 5376, "add gemma")
    cases["step norm f32 8192 add"] = step("norm", torch.float32, 8192, "add")
    cases["step gated bf16 14336"] = step("gated", torch.bfloat16, 14336)
    cases["step gated bf16 21504 gelu"] = step("gated", torch.bfloat16, 21504, "gelu")
    cases["step rope bf16 d128"] = step("rope", torch.bfloat16, 128)
    cases["step rope bf16 d128 se"] = step("rope", torch.bfloat16, 128, "se")
    cases["step rope bf16 d128 se norms"] = step("rope", torch.bfloat16, 128, "se norms")
    cases["step rope f32 d256 se norms"] = step("rope", torch.float32, 256, "se norms")
    return cases


def tilings() -> dict[str, Callable[[], object]]:
    """The tiles the GPU scripts time, on their shape (the 8B layer: bf16, head 128, GQA 4)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from check_fused_decode import CONFIGS as DECODE
    from check_fused_prefill import CONFIGS as PREFILL

    # named apart from the defaults' cases ("tiles ..."), so that --case "prefill bf16 d128" is the default
    # launch alone (the suite's compile; these ran on an H200, 2026-11-30)
    cases = {f"tiles prefill bf16 d128 {tuple(c)}": prefill(torch.bfloat16, 128, None, c) for c in PREFILL}
    for c in DECODE:
        cases[f"tiles decode bf16 d128 stored {tuple(c)}"] = decode(torch.bfloat16, 128, 4, "stored", c)
    return cases


def build(cases: dict[str, Callable[[], object]], arch: int) -> list[tuple[str, Built | str]]:
    """Each case's launches compiled for ``sm_{arch}``: (case, what was built), or (case, the error)."""
    out: list[tuple[str, Built | str]] = []
    for name, launch in cases.items():
        built: list[Built] = []
        try:
            with compiling_for(arch, built):
                launch()
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile is what this reports
            out.append((name, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e) else ''}"))
            continue
        out.extend((name, b) for b in built)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch",
        type=int,
        default=90,
        choices=[75, 80, 86, 89, 90, 100, 120],
        help="compute capability x10: 120 RTX 50, 100 B200, 90 H100/H200, 89 L4/L40S/RTX 40, 86 A10/RTX 30, "
        "80 A100, 75 T4",
    )
    every = {**defaults(), **tilings()}
    parser.add_argument(
        "--case", action="append", metavar="NAME", help="only these ('decode bf16': a prefix)"
    )
    args = parser.parse_args()
    cases = every
    if args.case:
        cases = {n: f for n, f in every.items() if any(n == c or n.startswith(c + " ") for c in args.case)}
        if missing := [c for c in args.case if not any(n == c or n.startswith(c + " ") for n in every)]:
            parser.error(f"no case named {missing[0]!r}; cases: {', '.join(every)}")
    failed = spilled = 0
    print(f"{'case':44} {'kernel':26} {'tiles':26} regs stack   smem per SM loops")
    for name, b in build(cases, args.arch):
        if isinstance(b, str):
            failed += 1
            print(f"{name:44} FAILED {b}")
            continue
        tiles = ",".join(
            f"{k[6:].lower() or 'n'}={v}" for k, v in b.constexprs.items() if k.startswith("BLOCK")
        )
        body = "/".join(map(str, b.loops))
        print(f"{name:44} {b.name:26} {tiles:26} {b.regs:4} {b.stack:5} {b.smem:6} {b.per_sm():6} {body}")
        spilled += b.stack > 0
        if b.per_sm() == 0:  # more shared memory than the GPU gives a program: the launch is refused
            failed += 1
            print(
                f"{name:44} FAILED {b.smem} bytes of shared memory: more than sm_{args.arch} gives a program"
            )
    print(f"sm_{args.arch}: {len(cases)} launches, {failed} failed to compile, {spilled} kernels spilled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
