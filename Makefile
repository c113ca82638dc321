# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install torch 2.13.0 first (a local CPU wheel on
# the development machines); any later requirement is satisfied by it, so pip never pulls the
# multi-GB CUDA packages.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.retouch-installed
RAY_STAMP := $(VENV)/.retouch-ray

.PHONY: demo test setup browser postgres lint format clean gpu-wheels gpu-site gpu-bench gpu-served

setup: $(STAMP)

comma := ,
# The venv, torch first (pip: the local wheel is found through pip's own configuration),
# then the project with the extras in $(1) in one uv run: uv resolves and installs the ~100
# packages in about 8 s where pip took about 70 s on 2 cores. The torch pin travels with
# it, so that a requirement 2.13.0 cannot satisfy fails the install instead of pulling the
# multi-GB CUDA build (uv reads no pip configuration and would find one on PyPI).
# Neither byte-compiles (pip: --no-compile, uv's default: compiling all ~18,000 modules of
# the environment takes about 45 s on 2 cores, where a run imports a fraction of them);
# the targets that run Python let the first import write its .pyc even where the
# environment sets PYTHONDONTWRITEBYTECODE, so that the project's own modules, too, are
# compiled once and not in every process a test starts.
TORCH := torch==2.13.0
WRITE_PYC := env -u PYTHONDONTWRITEBYTECODE
define install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile $(TORCH)
	test -x $(VENV)/bin/uv || $(PY) -m pip install -q --no-compile uv
	$(VENV)/bin/uv pip install -q --python $(PY) -e ".[$(1)]" "$(TORCH)"
endef

$(STAMP): pyproject.toml setup.py
	$(call install,dev)
	touch $(STAMP)

demo: setup
	$(WRITE_PYC) $(VENV)/bin/retouch demo

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

# Several gateways share a PostgreSQL state store: its tests start a real server from
# Debian's postgresql package (initdb + postgres on a free loopback port), installed here
# when missing (as root, with apt); elsewhere those tests are skipped and say why.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing postgresql (apt) for the shared state store's tests"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get install -y -q postgresql >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q postgresql >/dev/null; } || \
	    echo "warning: could not install postgresql: the shared state store's tests will be skipped"; \
	  else echo "note: no postgresql and not root: the shared state store's tests will be skipped"; fi; }

# The tests also cover the optional Ray provider: its extra (no torch in it) is installed
# with the rest in the same pip run (a second run would resolve everything again).
$(RAY_STAMP): pyproject.toml setup.py
	$(call install,dev$(comma)ray)
	touch $(STAMP) $(RAY_STAMP)

# One pytest-xdist worker per core (at least 2, at most 8: each holds its servers and an
# executor zygote), a test file each at a time (its module's server is its own), in the
# order tests/conftest.py collects them (xdist would put the files with the most tests
# first: the long end-to-end files, which have few, then ran last, one worker idle);
# tests/conftest.py gives them one torch thread each. The suite is bound by CPU: more
# workers than cores only add contention. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 2 ? 2 : n > 8 ? 8 : n )))
test: $(RAY_STAMP) browser postgres
	$(WRITE_PYC) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) retouch-demo build *.egg-info

# The GPU data path's benchmark, on a CUDA machine that has python3 with torch but no
# internet. `make gpu-wheels` (here, with the registries) puts the pure-Python packages such
# a machine lacks, and lmdb built for its Python, into .whl/; `make gpu-bench` (there)
# installs them beside its torch, runs the GPU tests (a failure is reported, the bench still
# runs), then `retouch bench production` over the production shapes at mask 0.2 (the
# acceptance's; GPU_MASKS=0.1,0.2,0.35 for the sweep), stock eager, replayed from CUDA graphs
# and, at batch GPU_COMPILE (empty: skipped), with its repeated blocks compiled (every ratio
# divides by the fastest), and writes gpu-bench.json and
# gpu-bench.md into $(GPU_OUT) (default $$OUT when set, else gpu-bench-out). With
# `make gpu-served` it is sized to about 9 minutes of an H100's or H200's time.
GPU_PYTHON ?= python3
GPU_PY_VERSION ?= 3.12
GPU_OUT ?= $(if $(OUT),$(OUT),gpu-bench-out)
GPU_SHAPES ?= flux-dev,sd3-medium,sd2-inpaint
GPU_MASKS ?= 0.2
GPU_REPEATS ?= 1
GPU_COMPILE ?= 1
GPU_WHEELS := diffusers==0.42.1 lmdb==3.0.0 starlette==1.10.0 uvicorn==0.54.0 \
	python-multipart==0.0.34 importlib-metadata==8.7.0
GPU_SITE := /tmp/retouch-gpu/site
GPU_SRC := /tmp/retouch-gpu/src
GPU_ENV := PYTHONPATH=$(GPU_SRC):$(GPU_SITE) PYTHONUNBUFFERED=1 TQDM_DISABLE=1

gpu-wheels: setup
	mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY_VERSION) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

gpu-site:
	@nvidia-smi -L
	@$(GPU_PYTHON) -c "import diffusers, lmdb, starlette" 2>/dev/null || \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --target $(GPU_SITE) .whl/*.whl
	@mkdir -p $(GPU_SRC)/retouch $(GPU_OUT) && for d in platform functions runtime cachestore; do \
	  ln -sfn $(CURDIR)/$$d $(GPU_SRC)/retouch/$$d; done

gpu-bench: gpu-site
	-$(GPU_ENV) timeout 120 $(GPU_PYTHON) -m pytest -q -p no:cacheprovider \
	  tests/runtime/maskaware/test_graphs.py tests/runtime/maskaware/test_tiers.py \
	  tests/runtime/executor/test_sleep.py -k "graph or device_tier or gpu or cuda"
	$(GPU_ENV) $(GPU_PYTHON) -m retouch.platform.cli.main \
	  bench production --device cuda --shapes $(GPU_SHAPES) --masks $(GPU_MASKS) --batch 1,4 \
	  --host-masks 0.2 --steps 8 --repeats $(GPU_REPEATS) --out $(GPU_OUT) \
	  $(if $(GPU_COMPILE),--compile-stock $(GPU_COMPILE))

# Served edits at production shapes on that machine: a real `retouch serve` per
# configuration, one executor on the GPU with the model made in memory (random weights,
# `retouch:flux-dev-shaped`), every edit its own beta mask (mean 0.2) on one template,
# Poisson arrivals at 0.5 and 0.8 of the stock configuration's measured capacity (both
# rates on each server: one start, profile, graph warm-up and bake), the stock pipeline
# replayed from CUDA graphs (the baseline, first) against mask-aware with graphs (the
# path chosen per edit). 6 steps instead of 28, so that the template's activations (about
# 25 GB) rest in the device tier beside the model; both configurations run the same steps.
# load.json and load.md (ratios to stock at each rate) into $(GPU_OUT)/served-<model>/.
# SD3 and SD2 as time allows: GPU_SERVED_MODELS="retouch:sd3-medium-shaped ...".
GPU_SERVED_MODELS ?= retouch:flux-dev-shaped
GPU_SERVED_STEPS ?= 6
gpu-served: gpu-site
	for m in $(GPU_SERVED_MODELS); do \
	  $(GPU_ENV) $(GPU_PYTHON) -m retouch.platform.cli.main bench load --model $$m \
	    --compare continuous+stock+graphs,continuous+graphs --rate auto:0.5,auto:0.8 \
	    --requests 16 --warmup 2 --steps $(GPU_SERVED_STEPS) --templates 1 --max-batch 2 \
	    --mask-mean 0.2 --host-cache-bytes 40000000000 --out $(GPU_OUT)/served-$${m#retouch:} \
	    || exit 1; done
