#!/usr/bin/env bash
# Greedy generation through a 2048-cell context-shift cache on Gemma 3 270M (Q4_K_M GGUF): our loop
# with float32 weights, int8 weights and int8 + Self-Extend G=4 W=1024, against llama.cpp
# (llama-cpp-python, pip install -e ".[llamacpp]") on the same GGUF file, interleaved in one process,
# the same 1024-token prompt, 1500 tokens each (one context shift), 2 repeats (medians).
# About 10 minutes on a quiet 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/speed/results/gemma3_bench.jsonl
rm -f "$out"
selfextend bench -m gemma3-270m --cases generate -g 4 -w 1024 --ctx 2048 --endless-tokens 1500 \
    --repeats 2 -o "$out" | tee experiments/speed/results/gemma3_bench_table.txt
