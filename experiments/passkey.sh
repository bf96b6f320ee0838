#!/usr/bin/env bash
# Passkey retrieval on the default model: 4k-32k tokens (up to 4x the trained window), passkey at
# 25% and 75% of the filler, plain against Self-Extend. About 30 minutes on a 2-core CPU. Resumable.
set -euo pipefail
cd "$(dirname "$0")/.."
out=experiments/results/passkey.jsonl
selfextend passkey --lengths 4k,8k,16k,32k --depths 0.25,0.75 --trials 1 \
    --method plain --method selfextend:G=6,W=1024 -o "$out"
selfextend plot "$out" -o experiments/results/passkey.png
python experiments/table.py "$out"
