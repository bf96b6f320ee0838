"""One 8,192-token prefill of SmolLM2 (float32), plain or Self-Extend G=4 W=1024, timed: run it with
PYTHONPATH pointing at two checkouts in turn (interleaved rounds) to compare a change's prefill cost.

    PYTHONPATH=/path/to/old python experiments/prefill_ab.py prefill-se
    PYTHONPATH=. python experiments/prefill_ab.py prefill-se
"""

import sys
import time

import torch

import selfextend
from selfextend.models import load_model

try:
    from selfextend.evaluation.corpus import default_books
except ImportError:  # a checkout from before the package was grouped by job
    from selfextend.corpus import default_books

case = sys.argv[1] if len(sys.argv) > 1 else "prefill-plain"
model, tokenizer = load_model("smollm2-135m", dtype="float32")
ids = tokenizer(default_books()["war-and-peace"][:40000], return_tensors="pt").input_ids[:, :8192]
if case == "prefill-se":
    selfextend.apply_self_extend(model, group_size=4, window=1024)
with torch.inference_mode():
    start = time.perf_counter()
    model(ids, logits_to_keep=1)
    print(f"{time.perf_counter() - start:.2f}")
