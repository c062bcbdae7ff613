# stream-rl: the two commands are `make demo` and `make test` (README).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
CACHE ?= $(HOME)/.cache/stream-rl
VENV := .venv
PY := $(VENV)/bin/python
UV := $(shell command -v uv 2>/dev/null || echo $(CACHE)/tools/bin/uv)
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)

.PHONY: setup test lint typecheck pytest docker-tools demo model clean-venv

setup: $(STAMP)
	@$(PY) -m stream_rl.cli kafka fetch --quiet

$(UV):
	@echo "uv not found: installing it into $(CACHE)/tools (once)"
	@$(PYTHON) -m venv $(CACHE)/tools && $(CACHE)/tools/bin/pip install -q uv==0.13.9

$(STAMP): pyproject.toml Makefile | $(UV)
	@test -x $(PY) || $(UV) venv -q --python $(PYTHON) $(VENV)
	@$(UV) pip install -q --python $(PY) -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

lint: setup
	$(VENV)/bin/ruff check stream_rl tests bench
	$(VENV)/bin/ruff format --check stream_rl tests bench

typecheck: setup
	$(VENV)/bin/mypy

# The `docker` tests' tools: Debian's docker.io and debootstrap, Compose v2 (built once, cached).
docker-tools:
	@deploy/docker/install.sh

pytest: setup docker-tools
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test: setup lint typecheck pytest

DEMO_MODEL := models/tiny-arith

# The demo's model: a tiny Qwen2 warm-started on the arithmetic task's format (built once).
$(DEMO_MODEL)/config.json: | setup
	$(VENV)/bin/stream-rl make-model --preset tiny --warm-start arithmetic --out $(DEMO_MODEL) --overwrite

demo: setup $(DEMO_MODEL)/config.json
	$(VENV)/bin/stream-rl run configs/demo-cpu.yaml

clean-venv:
	rm -rf $(VENV)
