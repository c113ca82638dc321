# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install torch 2.13.0 first (a local CPU wheel on
# the development machines); any later requirement is satisfied by it, so pip never pulls the
# multi-GB CUDA packages.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.retouch-installed

.PHONY: demo test setup lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/retouch demo

test: setup
	$(PY) -m pytest -q --durations=25

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) retouch-demo build *.egg-info
