# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create/refresh .venv idempotently: the install re-runs only when pyproject.toml or the constraints change.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.d9d-installed
# Machines without CUDA pin the CPU torch wheel; GPU machines take torch from their own index.
CONSTRAINTS := $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints/cpu.txt)
EXTRAS ?= test,dev,hf

.PHONY: install demo test lint typecheck pytest format clean

$(STAMP): pyproject.toml constraints/cpu.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	@touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python -m d9d.cli.main demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy

pytest: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test: lint typecheck pytest

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
