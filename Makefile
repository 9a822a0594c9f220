# Set-up contract: `make demo` runs the main job, `make test` runs lint, types and tests.
# Both create .venv and install everything they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here (a local CPU wheel) so that set-up never pulls CUDA packages;
# the package itself only asks for torch>=2.3.
TORCH_PIN ?= torch==2.13.0

.PHONY: all venv demo test check lint types unit test-slow test-cuda gpu-check bench bench-funnel clean

all: test

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_PIN)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/sgrld demo --force  # replaces the previous demo outputs in out/demo

lint: venv
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

types: venv
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest -q

check: lint types

test: check unit

test-slow: venv
	$(BIN)/pytest -q -m slow

test-cuda: venv  # on a machine with a CUDA build of torch and a GPU
	$(BIN)/pytest -q -m cuda

gpu-check: venv  # CUDA tests + every GPU benchmark, < 10 min, one report; skips without a GPU
	$(BIN)/python benchmarks/gpu_check.py $(or $(REPORT),out/gpu-check.md)

bench: venv
	$(BIN)/python benchmarks/step_time.py
	$(BIN)/python benchmarks/funnel_speed.py --skip-full

bench-funnel: venv
	$(BIN)/python benchmarks/funnel_speed.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
