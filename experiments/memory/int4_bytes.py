"""Weight bytes one decode step reads with each --weights form (the KV cache apart), from the loaded model.

python experiments/memory/int4_bytes.py [smollm2-135m gemma3-270m]

Uses the bench's own count (every weight once, one row of an embedding that is not the output head);
also prints how many linear layers each form holds as int4, int8 or float.
"""

from __future__ import annotations

import sys

from torch import nn

from selfextend.bench.speed import bytes_per_token
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model
from selfextend.models.quantize import WEIGHT_FORMATS, Int4Linear, Int8Linear


def main(models: list[str]) -> None:
    print("| model | --weights | MB read per token (weights) | int4 / int8 / float linear layers |")
    print("|---|---|---:|---|")
    for name in models:
        for weights in WEIGHT_FORMATS:
            model, _ = load_model(name, weights=weights)
            mb = bytes_per_token(model, ContextShiftCache(model, n_ctx=16), 0) / 1e6
            kinds = [type(m) for m in model.modules()]
            counts = [kinds.count(Int4Linear), kinds.count(Int8Linear), kinds.count(nn.Linear)]
            print(f"| {name} | {weights} | {mb:.1f} | {' / '.join(map(str, counts))} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["smollm2-135m"])
