#!/usr/bin/env bash
# run.sh's whole flow (the carried wheels installed aside, then check.py --dry-run) in a venv of the GPU
# machine's own packages at their versions (machine_packages.txt, from the device tool's KINDS.md): torch
# 2.11.0 (a CUDA build, with triton 3.6.0), transformers 5.17.0, huggingface_hub 1.33.0, accelerate 1.15.0,
# tokenizers 0.23.2, and no datasets, gguf, llguidance, fastapi or default model. What a GPU session meets
# first, but CUDA: a package the machine lacks, or one of the wrong version, fails here at no device time.
# The machine's Python is 3.12: python3.12 where there is one, else python3. The first build downloads
# about 4.5 GB.
#   bash experiments/gpu/prepare.sh; bash experiments/gpu/machine_venv.sh [--only parity,cli,8b]
# VENV=DIR picks the venv's folder (default /tmp/gpu-machine-venv, kept for the next run); PYTHON its Python.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-/tmp/gpu-machine-venv}
if [ -z "${PYTHON:-}" ]; then  # a python3.12 that runs (a pyenv shim may name a version not selected)
    PYTHON=python3; python3.12 -c "" 2>/dev/null && PYTHON=python3.12
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pin() { grep -m1 -E "^$1==" experiments/gpu/machine_packages.txt || echo "$1"; }  # its version where known
# numpy unpinned: the machine's 2.5.2 is not on this registry
machine=$(for n in torch accelerate huggingface-hub transformers tokenizers safetensors; do pin "$n"; done)
"$VENV/bin/pip" install -q $machine \
    numpy click tqdm psutil matplotlib jinja2 pyyaml regex requests httpx anyio typer sentencepiece pytest \
    2>&1 | grep -v "^WARNING" || true
rm -rf .gpu/site  # run.sh installs the carried wheels afresh, as on a bare machine; gone after too (carry
trap 'rm -rf .gpu/site' EXIT  # [".gpu"] sends the folder, 64 MiB at most with the tree: the wheels, not both)
PATH="$VENV/bin:$PATH" bash experiments/gpu/run.sh --dry-run "$@"
