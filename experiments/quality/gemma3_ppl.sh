#!/usr/bin/env bash
# Perplexity against length on the second real model, Gemma 3 270M (trained window 32k; 15 of its 18
# layers slide over 512 tokens), first 64k tokens of sherlock-holmes, float32: plain against
# Self-Extend G=4 W=1024 up to twice the window. One forward per method at the longest length scores
# every shorter prefix (both methods are causal), so the cost is that of the 64k forwards.
# Cost on the 2-core CPU (quiet): a 16k forward 245 s plain; see docs/models.md "Hybrid attention (Gemma 3)"
# for the 64k figures. Plain runs transformers' own SDPA path, whose sliding layers use a dense
# (L x L) mask and so cost quadratically; Self-Extend's sliding layers attend their band block by block.
# Resumable: rerun to continue after an interruption.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/quality/results/gemma3_ppl.jsonl
selfextend ppl -m gemma3-270m --docs sherlock-holmes --lengths 4k,8k,16k,32k,48k,64k \
    --method selfextend:G=4,W=1024 -o "$out"
selfextend ppl -m gemma3-270m --docs sherlock-holmes --lengths 4k,8k,16k,32k,48k,64k \
    --method plain -o "$out"
selfextend plot "$out" -o experiments/quality/results/gemma3_ppl.png
selfextend table "$out"
selfextend table "$out" --field ppl
