# make engine | serve | test | bench | bench-pa   (see README.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BUILD ?= build
BACKEND ?= cpu
MODEL ?=
PRESET ?=
ENGINE_FLAGS := --backend $(BACKEND) --output-dir $(BUILD) $(if $(MODEL),--model $(MODEL)) $(if $(PRESET),--preset $(PRESET))

.PHONY: install engine serve test soak bench bench-pa clean lint

# A venv with every role's pinned dependencies; rebuilt when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	$(PY) -m pip install --quiet -e '.[frontend,engine,dev]'
	touch $@

install: $(VENV)/.installed

engine: install
	$(PY) -m build_engine $(ENGINE_FLAGS)

# Builds the default demo engine only if none exists (or if MODEL/PRESET asks for another one).
serve: install
	$(PY) -m build_engine --if-missing $(ENGINE_FLAGS)
	$(PY) -m launcher serve --model-repository $(BUILD)/model_repository --work-dir $(BUILD)

test: install
	$(PY) -m pytest -q

# 32 concurrent streams for 3 minutes (SOAK_SECONDS to change): zero errors, frontend RSS flat; prints figures.
soak: install
	$(PY) -m pytest -q -s -m slow tests/integration/test_soak.py

# Load tests (benchmarks/README.md): raw Triton vs the frontend vs the naive baseline, same workload;
# results in benchmarks/results/<date>[-quick]/. QUICK=1: the short workload (under 2 minutes).
QUICK_FLAG = $(if $(filter-out 0,$(QUICK)),--quick)
bench: install
	$(PY) -m build_engine --if-missing --preset small --output-dir $(BUILD)/bench
	$(PY) -m benchmarks.stack_bench --model-repository $(BUILD)/bench/model_repository --work-dir $(BUILD)/bench $(QUICK_FLAG)

# perf_analyzer 2.51 (installed into $(BUILD)/perf_analyzer, not the venv) streaming gRPC sweep.
bench-pa: install
	$(PY) -m build_engine --if-missing --preset small --output-dir $(BUILD)/bench
	PY=$(PY) PA_DIR=$(abspath $(BUILD))/perf_analyzer bash benchmarks/perf_analyzer/run_sweep.sh \
		--model-repository $(BUILD)/bench/model_repository --work-dir $(BUILD)/bench $(QUICK_FLAG)

# docker/: the compose file must validate (docker-compose v1 from Debian, no daemon needed) and the
# Dockerfiles must pass hadolint (pinned in the dev extra). MODEL_DIR is only interpolated, never read.
lint: install
	command -v docker-compose >/dev/null || { apt-get update -qq && apt-get install -y -qq docker-compose; }
	MODEL_DIR=/models/hf docker-compose -f docker/compose.yaml config --quiet
	$(VENV)/bin/hadolint docker/Dockerfile.trtllm docker/Dockerfile.frontend

clean:
	rm -rf $(BUILD)
