#!/usr/bin/env bash
# Perplexity against length on the default model (SmolLM2-135M, trained window 8k) and corpus:
# two books, 2k-32k tokens, plain against two Self-Extend settings, dynamic NTK and context shift.
# About 80 minutes on a 2-core CPU (float32; the forwards of results/ppl_sweep.jsonl took 82). Resumable: rerun to continue after an interruption.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/quality/results/ppl_sweep.jsonl
selfextend ppl --docs sherlock-holmes,war-and-peace --lengths 2k,4k,8k,16k,32k \
    --method plain --method selfextend:G=6,W=1024 --method selfextend:G=8,W=2048 \
    --method ntk:factor=4 --method shift:ctx=2048,keep=4 -o "$out"
selfextend plot "$out" -o experiments/quality/results/ppl_sweep.png
selfextend plot "$out" --ratio -o experiments/quality/results/ppl_sweep_ratio.png
selfextend plot "$out" --per-doc -o experiments/quality/results/ppl_sweep_per_doc.png
selfextend plot "$out" --field ppl -o experiments/quality/results/ppl_sweep_overall.png
selfextend table "$out"
selfextend table "$out" --ratio
