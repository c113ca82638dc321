# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install torch 2.13.0 first (a local CPU wheel on
# the development machines); any later requirement is satisfied by it, so pip never pulls the
# multi-GB CUDA packages.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.retouch-installed
RAY_STAMP := $(VENV)/.retouch-ray

.PHONY: demo test setup browser lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/retouch demo

# The web page's test drives Debian's chromium with Selenium: installed here when missing
# (as root, with apt); elsewhere that one test is skipped and says why.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing chromium and chromium-driver (apt) for the web page's test"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null; } || \
	    echo "warning: could not install chromium: the web page's browser test will be skipped"; \
	  else echo "note: no chromium and not root: the web page's browser test will be skipped"; fi; }

# The tests also cover the optional Ray provider: install the extra (no torch in it).
$(RAY_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[dev,ray]"
	touch $(RAY_STAMP)

test: setup $(RAY_STAMP) browser
	$(PY) -m pytest -q --durations=25

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) retouch-demo build *.egg-info
