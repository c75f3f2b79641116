# `make demo` and `make test` work from a fresh clone: they create .venv and install everything.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_ENABLED=0

.PHONY: install demo test lint docs format bench clean

# onnx2torch (ONNX input) goes in without its torchvision requirement, as the README's install
# line says: PyPI's torchvision is built for CUDA torch and does not import beside the CPU torch
# pinned here (and onnx2torch, which imports it, then fails outside tessel)
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	$(BIN)/pip install -q -c constraints.txt --no-deps "onnx2torch>=1.5"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tessel demo

# two pytest processes, each taking whole test files or test classes (a file's tests share its
# sessions and their workers); TEST_PROCESSES=0 runs them in this one
TEST_PROCESSES ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadscope --durations=15 tests

# mypy checks the packages pyproject's [tool.mypy] lists (sharding, package, config, plan, lower, slices)
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

# the documentation site, into site/ (git-ignored): strict, so a warning (a broken link or anchor,
# a page left out of mkdocs.yml's nav, a docstring mkdocstrings cannot read) fails it
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks examples
	$(BIN)/ruff check --fix src tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info .pytest_cache
