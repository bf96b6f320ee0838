#!/usr/bin/env bash
# Issue 27's rows per model size: greedy generation through a context-shift cache (our gguf and int4
# weights, each plain and with Self-Extend G=4 W=1024, against llama.cpp on the same GGUF through
# llama-cpp-python: pip install -e ".[llamacpp]"), interleaved per round, with bytes per token, GB/s
# and the machine's read bandwidth measured in the same run; then the first token of a 1k and an 8k prompt
# (rows name the prefill engine).
# On a CPU with AMX, build llama-cpp-python without it (llama.cpp's AMX path died there with SIGILL):
#   CMAKE_ARGS="-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='...the same'"
# Models: SmolLM2 (embedded), Gemma 3 270M (the gemma extra) and a 1B-class GGUF with Llama-3.2-1B's
# shapes made by experiments/tools/make_dev_model.py ($DEV_MODEL). Results: experiments/speed/results/bench_sizes*.
#
#     python experiments/tools/make_dev_model.py --shape llama-3.2-1b   # into ./dev-models
#     bash experiments/speed/bench_sizes.sh   # DEV_MODEL=PATH for a model elsewhere
set -euo pipefail
cd "$(dirname "$0")/../.."
dev=${DEV_MODEL:-dev-models/llama-3.2-1b-synthetic-Q4_K_M.gguf}
out=experiments/speed/results/bench_sizes.jsonl
threads=${THREADS:-2}
run() { selfextend bench --weights gguf --forms gguf,int4 -t "$threads" --cases generate "$@" -o "$out"; }
for model in smollm2-135m gemma3-270m; do
    for ctx in 512 2048; do
        run -m "$model" --ctx "$ctx" --endless-tokens 300 --repeats 3
    done
done
run -m "$dev" --ctx 2048 --endless-tokens 64 --repeats 2
# the first token by the prefill engine auto picks here (bf16 where the CPU has AMX), then by int8: both rates
selfextend bench --weights gguf --forms gguf -t "$threads" -m "$dev" --cases first-token --lengths 1k,8k \
    --repeats 2 -o "$out"
SELFEXTEND_PREFILL=int8 selfextend bench --weights gguf --forms gguf -t "$threads" -m "$dev" \
    --cases first-token --lengths 1k --repeats 2 -o "$out"
