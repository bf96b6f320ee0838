#!/usr/bin/env bash
# Passkey retrieval on the default model (trained window 8k), plain against Self-Extend:
# 4k-16k tokens with the key at 25% and 75% of the filler, and 32k (4x the window) at 50%.
# About 40 minutes on a 2-core CPU (results/passkey.jsonl: 42; a 32k prompt costs a few minutes per method). Resumable.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/quality/results/passkey.jsonl
methods=(--method plain --method selfextend:G=6,W=1024)
selfextend passkey --lengths 4k,8k,16k --depths 0.25,0.75 --trials 1 "${methods[@]}" -o "$out"
selfextend passkey --lengths 32k --depths 0.5 --trials 1 "${methods[@]}" -o "$out"
selfextend plot "$out" -o experiments/quality/results/passkey.png
selfextend table "$out"
