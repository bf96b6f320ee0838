"""Make a target/draft GGUF pair for speculative decoding with a draft model, from the models installed
offline: the target is a real model requantized to a higher precision, the draft its shipped file.

No real pair of different sizes sharing a vocabulary can be installed here (no hub; the packaged models,
SmolLM2-135M-Instruct and Gemma 3 270M, have different vocabularies), so the pair is one model at two
precisions: target = the shipped weights written as F16 (or Q8_0) by llama.cpp's ``llama-quantize
--allow-requantize``, draft = the shipped Q4_1 (Gemma: Q4_K_M) file. The F16 target reads ~3x the bytes
per token of its draft (SmolLM2: 271 MB against 98 MB; Gemma 3: 543 MB against 253 MB), as a bigger target
would, and since its values are the draft's own dequantized, the two disagree only where the activations'
rounding does (the draft's products round them to 8-bit blocks, an F16 target's take float32): a
high-acceptance pair (llama-server kept 95-99% of its drafts), the best case of a draft model. Q8_0
rounds the dequantized values again, a little further from the draft.

    python experiments/speed/make_draft_pair.py [--out /work/dev-models] [--type F16] [--gemma]

Writes ``OUT/<shipped name>.<TYPE>.gguf`` (skipped when present) and prints the target and draft paths,
ready for ``spec_vs_llamacpp.py --target T --draft D``.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from selfextend.models.sources import resolve_model

LLAMA_QUANTIZE = Path("/tmp/lcp-t49/build-server/bin/llama-quantize")
OUT = Path("/work/dev-models")  # outside git: ~270 MB per SmolLM2 F16 file, ~540 MB for Gemma's


def requantized(source: Path, kind: str, out: Path, quantize: Path) -> Path:
    """``source`` written as ``kind`` (F16, BF16, Q8_0...) under ``out`` by ``quantize``; kept if present."""
    target = out / f"{source.stem}.{kind}.gguf"
    if not target.is_file():
        out.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        cmd = [str(quantize), "--allow-requantize", str(source), str(tmp), kind]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tmp.rename(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder for the target files (outside git)")
    parser.add_argument("--type", default="F16", help="the target's llama.cpp type: F16, BF16, Q8_0")
    parser.add_argument("--gemma", action="store_true", help="also the Gemma 3 270M pair")
    parser.add_argument("--llama-quantize", type=Path, default=LLAMA_QUANTIZE)
    args = parser.parse_args()
    if not args.llama_quantize.is_file():
        parser.error(f"no llama-quantize at {args.llama_quantize}")
    for name in ["smollm2-135m"] + ["gemma3-270m"] * args.gemma:
        draft = resolve_model(name).gguf_path  # the shipped file, found as the CLI finds it
        assert draft is not None  # an alias always names a GGUF
        target = requantized(draft, args.type, args.out, args.llama_quantize)
        mb = target.stat().st_size / 1e6, draft.stat().st_size / 1e6
        print(f"--target {target} --draft {draft}  ({mb[0]:.0f} MB and {mb[1]:.0f} MB)")


if __name__ == "__main__":
    main()
