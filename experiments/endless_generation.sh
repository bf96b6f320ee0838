#!/usr/bin/env bash
# Endless generation on the default model: 20,000 tokens through a 1024-token context-shift cache.
# Every 1000 tokens a JSON line (tokens/s over those 1000, resident MiB, shifts) goes to the results.
# About 15 minutes on a 2-core CPU (float32), with nothing else running.
set -euo pipefail
cd "$(dirname "$0")/.."
selfextend generate -p "Tell me a long story about a lighthouse keeper and the sea." --ctx 1024 \
    --max-new-tokens 20000 --ignore-eos --seed 1 --stats-every 1000 \
    2> >(tee experiments/results/endless_generation.log >&2) > /dev/null
grep '^{' experiments/results/endless_generation.log > experiments/results/endless_generation.jsonl
tail -n 1 experiments/results/endless_generation.log
