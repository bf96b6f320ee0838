#!/usr/bin/env bash
# Everything the GPU checks need that a bare GPU machine lacks, into ./.gpu (ignored by git, carried to the
# device by the device tool's `carry`): wheels of the library's dependencies named in carried.txt at this
# venv's versions (the GPU machine has torch, numpy, click, accelerate and huggingface_hub 1.33, which
# transformers 5.24 takes, but transformers 5.17 and no gguf/llguidance/fastapi; fastapi needs
# opentelemetry-api, pydantic a typing-extensions >= 4.16), and a tiny model with the default model's
# tokenizer and chat template, for the CLI's commands. Not huggingface_hub: ours (2.x) needs httpx2, which
# the machine lacks. machine_venv.sh runs the whole flow in a venv of the machine's packages.
# Run from the repository root after `make install`:  bash experiments/gpu/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
rm -rf .gpu && mkdir -p .gpu/wheels
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for name in $(grep -v '^#' experiments/gpu/carried.txt); do
    [ "$name" = pydantic-core ] || pins+=("$name==$(version "$name")")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels "${pins[@]}"
# pydantic-core is built per Python version: one wheel for each the GPU machine might have
core="pydantic-core==$(version pydantic-core)"
for v in 3.10 3.11 3.12 3.13; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" -d .gpu/wheels "$core" || true
done
"$PY" experiments/gpu/tiny_model.py .gpu/tiny
du -sh .gpu/wheels .gpu/tiny
# what the device tool sends with carry [".gpu"]: the tracked tree and .gpu, 64 MiB at most
total=$(( $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) + $(du -sb .gpu | cut -f1) ))
echo "the tree and .gpu: $((total / 1048576)) MiB of the 64 MiB the device tool sends"
[ "$total" -le $((64 * 1048576)) ] || { echo "error: over the device tool's 64 MiB" >&2; exit 1; }
