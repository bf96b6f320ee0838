#!/usr/bin/env bash
# Passkey retrieval on Gemma 3 270M (trained window 32k), float32, the key in the middle of the filler,
# one trial per point: Self-Extend G=4 W=1024 at 4k, 16k, 1x (32k) and 2x (64k) the window; plain at
# 4k, 16k and 32k (inside the window: the control) and 64k. Each prompt is one long forward (a 64k one
# costs tens of minutes on this CPU). Resumable: rerun to continue after an interruption.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/quality/results/gemma3_passkey.jsonl
opts=(-m gemma3-270m --depths 0.5 --trials 1 -o "$out")
selfextend passkey --lengths 4k,16k,32k,64k --method selfextend:G=4,W=1024 "${opts[@]}"
selfextend passkey --lengths 4k,16k,32k --method plain "${opts[@]}"
selfextend passkey --lengths 64k --method plain "${opts[@]}"
selfextend table "$out"
