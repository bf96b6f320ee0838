"""Self-Extend keeps the default model's perplexity flat past its trained window.

One 16k-token excerpt of a default-corpus book, scored in one forward by the plain model
and by Self-Extend (G=4, W=1024); prints and writes the perplexity of the 4k-8k and 8k-16k
parts. About 5 minutes on a 2-core CPU (fp32).

    python experiments/quality/self_extend_ppl.py [--book sherlock-holmes] [--tokens 16384]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import selfextend
from selfextend.evaluation.corpus import default_books
from selfextend.evaluation.nll import segment_ppl, token_nll
from selfextend.models import load_model

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--book", default="sherlock-holmes")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=RESULTS / "self_extend_ppl.json")
    args = ap.parse_args()

    torch.manual_seed(0)
    model, tokenizer = load_model("smollm2-135m", dtype=torch.float32)
    text = default_books()[args.book]
    ids = tokenizer(text[: args.tokens * 8], return_tensors="pt").input_ids[:, : args.tokens]
    n = ids.shape[1]
    assert n == args.tokens, f"book too short: {n} tokens"
    q = n // 4
    rows = {}
    for name in ("plain", f"selfextend G={args.group_size} W={args.window}"):
        t0 = time.perf_counter()
        if name == "plain":
            nll = token_nll(model, ids)
        else:
            with selfextend.self_extend(model, args.group_size, args.window):
                nll = token_nll(model, ids)
        rows[name] = {
            "ppl_4k_8k": segment_ppl(nll, q, 2 * q),
            "ppl_8k_16k": segment_ppl(nll, 2 * q, n),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        r = rows[name]
        r["ratio_late_to_mid"] = r["ppl_8k_16k"] / r["ppl_4k_8k"]
        print(
            f"{name:28s} PPL[{q}:{2 * q}) {r['ppl_4k_8k']:8.2f}  PPL[{2 * q}:{n}) {r['ppl_8k_16k']:8.2f}"
            f"  ratio {r['ratio_late_to_mid']:.3f}  ({r['seconds']} s)",
            flush=True,
        )
    record = {
        "model": "smollm2-135m",
        "book": args.book,
        "tokens": n,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
