# Two entry points for a fresh machine with Python 3.11+:
#   make run   - bring up the whole router locally (Ctrl-C stops it)
#   make test  - run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/prefix-router up --exit-with-parent true $(ARGS)

test: $(STAMP)
	scripts/ensure-test-services
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo
	$(BIN)/pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) run .pytest_cache .mypy_cache .ruff_cache
