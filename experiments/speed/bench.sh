#!/usr/bin/env bash
# Speed and memory on the default model, float32, every variant side by side in one process:
# prefill 4k-16k (plain SDPA, our Self-Extend, the full-matrix reference up to 8k), decode at 4k and
# 12k cached tokens, generation through a 2048-token context-shift cache against plain decoding at
# its average fill, and float against int8 weights against llama.cpp (when llama-cpp-python is
# installed: pip install -e ".[llamacpp]") on the same GGUF file.
# About 30 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/speed/results/bench.jsonl
rm -f "$out"
selfextend bench --lengths 4k,8k,16k --decode-lengths 4k,12k -g 4 -w 1024 --repeats 2 \
    --ctx 2048 --endless-tokens 1500 -o "$out" | tee experiments/speed/results/bench_table.txt
selfextend plot "$out" -o experiments/speed/results/bench.png
