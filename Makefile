# Set-up contract: `make demo` runs the main job, `make test` runs lint, types and tests.
# Both create .venv and install everything they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch: a torch already importable in .venv is always kept (a CUDA build installed by hand
# included), and so is one of $(PYTHON) with VENV_FLAGS=--system-site-packages. Otherwise
# TORCH_PIN is installed: torch==2.13.0, the version CI tests. Which build pip picks depends on
# its configuration: on an ordinary Linux machine the default PyPI build with its CUDA libraries
# (several GB); TORCH_PIN='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu' gets
# the CPU build; TORCH_PIN= installs none here (then pip installs torch>=2.3 from the package's
# dependencies). The package itself only asks for torch>=2.3.
TORCH_PIN ?= torch==2.13.0
VENV_FLAGS ?=
HAS_TORCH = $(BIN)/python -c "import torch" 2>/dev/null

.PHONY: all venv demo test check lint types unit docs test-slow test-cuda gpu-check bench bench-funnel clean

all: test

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@if $(HAS_TORCH); then \
		echo "keeping the installed $$($(BIN)/python -c 'import torch; print("torch", torch.__version__)')"; \
	elif [ -n "$(TORCH_PIN)" ]; then \
		echo "installing $(TORCH_PIN)"; $(BIN)/pip install --quiet $(TORCH_PIN); \
	fi
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# test-only, installed by the test targets and not by `make venv` or `make demo`:
# tests/test_llc*.py compare with devinterp's SGLD; its devinterp.optim needs only torch and
# numpy, the rest of its dependencies (datasets, ...) is not wanted. The hf extra (transformers,
# peft) for tests/test_huggingface.py.
$(BIN)/.test-deps: $(BIN)/.installed
	$(BIN)/pip install --quiet --no-deps 'devinterp==2.0.1'
	$(BIN)/pip install --quiet -e '.[dev,hf]'
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/sgrld demo --force  # replaces the previous demo outputs in out/demo

lint: venv
	$(BIN)/ruff check src tests benchmarks examples scripts
	$(BIN)/ruff format --check src tests benchmarks examples scripts

types: venv
	$(BIN)/mypy

unit: venv $(BIN)/.test-deps
	$(BIN)/pytest -q

check: lint types

# The site from docs/ and the docstrings, into site/ (tests/test_docs.py builds it too, in make
# test): --strict fails on a broken link, a missing reference or an unreadable docstring.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test: check unit

test-slow: venv $(BIN)/.test-deps
	$(BIN)/pytest -q -m slow

test-cuda: venv  # on a machine with a CUDA build of torch and a GPU; never replaces that torch
	@$(BIN)/python -c "import torch; torch.cuda.is_available() or print('make test-cuda: torch', \
		torch.__version__, 'sees no CUDA device, so the cuda tests are skipped (a CUDA build: \
	docs/gpu.md)')"
	$(BIN)/pytest -q -m cuda

gpu-check: venv  # CUDA tests + every GPU benchmark, < 10 min, one report; skips without a GPU
	$(BIN)/python benchmarks/gpu_check.py $(or $(REPORT),out/gpu-check.md)

bench: venv
	$(BIN)/python benchmarks/step_time.py
	$(BIN)/python benchmarks/funnel_speed.py --skip-full

bench-funnel: venv
	$(BIN)/python benchmarks/funnel_speed.py

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
