#!/usr/bin/env bash
# Perplexity of --weights gguf with each prefill engine (models/quant.py: chunk_engine; the bf16 engine
# dequantizes weight tiles to bfloat16, the int8 one rounds activations to int8 per block) against the
# float model, on the default corpus (SmolLM2, two books, 2k and 4k tokens, plain attention): whether the
# faster engine costs quality. A few minutes on 2 cores; prints each file's rows.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/quality/results/prefill_engines_ppl
for engine in int8 bf16; do
    SELFEXTEND_PREFILL=$engine selfextend ppl --weights gguf --docs sherlock-holmes,war-and-peace \
        --lengths 2k,4k --method plain -t 2 -o "${out}_${engine}.jsonl"
done
selfextend ppl --weights float --docs sherlock-holmes,war-and-peace --lengths 2k,4k --method plain -t 2 \
    -o "${out}_float.jsonl"
for f in "${out}"_{int8,bf16,float}.jsonl; do echo "$f"; python -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f\"  {r['doc']:16} {r['length']:5} {r['ppl']:.3f}\")" "$f"; done
