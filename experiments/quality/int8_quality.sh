#!/usr/bin/env bash
# Perplexity with int8 weights (the default of `selfextend generate`) and with int4 weights (the GGUF's
# own 4-bit blocks) against float32, on the default corpus: two books, the first 2k-8k tokens, the plain
# model and Self-Extend at 16k. About 8 minutes per weight format on a 2-core CPU. Resumable: points
# already in the results file are skipped. Prints the table of the three and their ratios.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/quality/results/int8_quality.jsonl
for weights in float int8 int4; do
    selfextend ppl --weights "$weights" --docs sherlock-holmes,war-and-peace --lengths 2k,4k,8k \
        --method plain -o "$out"
    selfextend ppl --weights "$weights" --docs sherlock-holmes --lengths 16k \
        --method selfextend:G=4,W=1024 -o "$out"
done
python experiments/quality/int8_table.py "$out"
