#!/usr/bin/env bash
# Passkey retrieval on Gemma 3 270M (trained window 32k) at 1x and 2x its window, float32, the key in
# the middle of the filler: plain at 32k (inside the window: the control) and 64k, Self-Extend
# G=4 W=1024 at both. One trial per point: each prompt is one long forward (a 64k plain forward costs
# about as much as the whole Self-Extend part; see README "Hybrid attention (Gemma 3)"). Resumable.
set -euo pipefail
cd "$(dirname "$0")/.."
out=experiments/results/gemma3_passkey.jsonl
se=(--method selfextend:G=4,W=1024)
selfextend passkey -m gemma3-270m --lengths 32k,64k --depths 0.5 --trials 1 "${se[@]}" -o "$out"
selfextend passkey -m gemma3-270m --lengths 32k --depths 0.5 --trials 1 --method plain -o "$out"
selfextend passkey -m gemma3-270m --lengths 64k --depths 0.5 --trials 1 --method plain -o "$out"
selfextend table "$out"
