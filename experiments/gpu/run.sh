#!/usr/bin/env bash
# On a GPU machine, from the repository root: install the carried wheels (.gpu/wheels, made by prepare.sh)
# into .gpu/site without touching the machine's own packages, then run every GPU check.
#   bash experiments/gpu/run.sh [--short] [--only parity,cli,8b,kernel]
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -d .gpu/wheels ] || [ ! -d .gpu/tiny ]; then
    echo "error: no .gpu/wheels or .gpu/tiny: run experiments/gpu/prepare.sh where selfextend is installed," \
        "then carry .gpu" >&2
    exit 2
fi
[ -d .gpu/site ] || python -m pip install -q --no-deps --no-index --find-links .gpu/wheels --target .gpu/site \
    $(grep -v '^#' experiments/gpu/carried.txt) 2>&1 | grep -v "^WARNING" || true  # once a machine
export PYTHONPATH="$PWD/.gpu/site:$PWD" HF_HUB_OFFLINE=1 SELFEXTEND_COMPILE=0 PYTHONUNBUFFERED=1
# the whole output also into $OUT/check.log (the device tool returns only the output's tail, and what is
# under $OUT even when the run is cut off)
mkdir -p "${OUT:-.}"
python experiments/gpu/check.py "$@" 2>&1 | tee "${OUT:-.}/check.log"
