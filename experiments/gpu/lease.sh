#!/usr/bin/env bash
# One device lease's run: check.py's sections, each in its own process under its own time limit. A section
# that hangs, or breaks the GPU's context, costs only its own seconds; the others still run and come back.
# What comes back (the device tool returns 8 files): $OUT/gpu_check.jsonl, every section's records
# appended as each ends; $OUT/SECTION.log, its whole output (written as it runs); the CLI section's
# parted outputs ($OUT/cli/cli_outputs.json).
#   bash experiments/gpu/lease.sh kernel:110 parity:70 "8b:150:--short" ...   (SECTION:SECONDS[:FLAGS])
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-.}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
for spec in "$@"; do
    IFS=: read -r section seconds flags <<< "$spec"
    if [[ ! "$seconds" =~ ^[0-9]+$ ]]; then
        echo "lease.sh: each argument is SECTION:SECONDS[:FLAGS] (kernel:110), not '$spec'" >&2
        exit 2
    fi
    mkdir -p "$out/$section"
    start=$SECONDS
    OUT="$out/$section" timeout "$seconds" bash experiments/gpu/run.sh --only "$section" $flags
    echo "== section $section: exit $? after $((SECONDS - start)) s (limit $seconds)"
    cat "$out/$section/gpu_check.jsonl" >> "$out/gpu_check.jsonl" 2>/dev/null
    mv "$out/$section/check.log" "$out/$section.log" 2>/dev/null
    rm -f "$out/$section/gpu_check.jsonl"
    rmdir "$out/$section" 2>/dev/null
done
