#!/usr/bin/env bash
# Endless generation on the default model (or MODEL): TOKENS tokens (default 20,000) through a context-shift cache.
# Every 1000 tokens a JSON line (tokens/s over those 1000, resident MiB, shifts) goes to the results.
#   CTX=1024 WEIGHTS=float bash experiments/memory/endless_generation.sh   # ~15 minutes on a 2-core CPU
#   CTX=2048 WEIGHTS=int8  bash experiments/memory/endless_generation.sh   # int8 weights, ~8 minutes
#   TOKENS=100000 bash experiments/memory/endless_generation.sh            # the 100k-token run (~20 minutes;
#       the script's default weights: int4 from the GGUF's 4-bit blocks; generate's own default is gguf):
#       prints RSS at 5k and at the end, and tokens/s of tokens 5k-10k against the last 5k
#   COMPILE=1 ...                                                    # decode through the compiled step
#   MODEL=gemma3-270m ...                                            # another shipped model
set -euo pipefail
cd "$(dirname "$0")/../.."
ctx=${CTX:-2048}
weights=${WEIGHTS:-int4}
tokens=${TOKENS:-20000}
model=${MODEL:-smollm2-135m}
compile=--no-compile
name=experiments/memory/results/endless_generation_ctx${ctx}_${weights}
if [ "$model" != smollm2-135m ]; then name=experiments/memory/results/endless_generation_${model}_ctx${ctx}_${weights}; fi
if [ "${COMPILE:-0}" = 1 ]; then compile=--compile; name=${name}_compiled; fi
if [ "$tokens" != 20000 ]; then name=${name}_${tokens}; fi
selfextend generate -m "$model" -p "Tell me a long story about a lighthouse keeper and the sea." --ctx "$ctx" \
    --weights "$weights" --max-new-tokens "$tokens" --ignore-eos --seed 1 --stats-every 1000 "$compile" \
    2> >(tee "$name.log" >&2) > /dev/null
grep '^{' "$name.log" > "$name.jsonl"
tail -n 1 "$name.log" | tee "${name}_summary.txt"
rm "$name.log"
python experiments/memory/endless_summary.py "$name.jsonl" | tee -a "${name}_summary.txt"
