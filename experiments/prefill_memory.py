"""Peak resident memory of an 8k prompt written as ``selfextend generate`` writes it: plain and Self-Extend.

Each run is a fresh process: the default model and weights, the cache ``generate`` would make (``--ctx``,
the default cache type), the prompt fed in 512-token pieces and one token decoded, so the cells, Self-
Extend's grouped keys and the decode step's buffers all count. Reported: the process's peak RSS (VmHWM),
and the part the prompt added over the loaded model; variants alternate so machine noise hits both.

    nice python experiments/prefill_memory.py [--tokens 8192] [--ctx 8448] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

VARIANTS = ("plain", "selfextend")


def worker(variant: str, tokens: int, ctx: int, group_size: int, window: int) -> None:
    """One prompt in this process; prints a JSON line."""
    import selfextend
    from selfextend.bench.runner import status_kib
    from selfextend.evaluation.corpus import default_books
    from selfextend.generation.generator import Generator, decode_settings
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models import load_model

    model, tokenizer = load_model("smollm2-135m", weights="auto")  # generate's default weights
    ids = tokenizer(default_books()["sherlock-holmes"][: tokens * 8]).input_ids[:tokens]
    if variant == "selfextend":
        selfextend.apply_self_extend(model, group_size, window)
    compile_step, dtype = decode_settings(model)
    gen = Generator(model, ContextShiftCache(model, n_ctx=ctx, dtype=dtype), compile=compile_step)
    base = status_kib("VmRSS")
    logits = gen.feed(ids, 512)
    gen.write([int(logits.argmax())])
    peak = status_kib("VmHWM")
    record = {
        "variant": variant,
        "tokens": tokens,
        "peak_mib": peak / 1024,
        "added_mib": (peak - base) / 1024,
    }
    print(json.dumps(record))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=8448)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    settings = [str(v) for v in (args.tokens, args.ctx, args.group_size, args.window)]
    if args.worker:
        worker(args.worker, *(int(s) for s in settings))
        return
    runs = []
    for rep in range(args.repeats):
        for variant in VARIANTS:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                variant,
                "--tokens",
                settings[0],
                "--ctx",
                settings[1],
            ]
            cmd += ["--group-size", settings[2], "--window", settings[3]]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
            r = runs[-1]
            print(
                f"[{rep}] {variant:10s} peak {r['peak_mib']:7.0f} MiB (the prompt added {r['added_mib']:.0f})"
            )
    med = {
        v: {k: statistics.median(r[k] for r in runs if r["variant"] == v) for k in ("peak_mib", "added_mib")}
        for v in VARIANTS
    }
    ratio = {k: med["selfextend"][k] / med["plain"][k] for k in ("peak_mib", "added_mib")}
    print(
        f"Self-Extend / plain, {args.tokens} tokens, --ctx {args.ctx}: peak RSS {ratio['peak_mib']:.2f}x, "
        f"memory the prompt added {ratio['added_mib']:.2f}x"
    )


if __name__ == "__main__":
    main()
