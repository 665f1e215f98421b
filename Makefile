# make engine | serve | rollout | rollback | test | docs | bench | bench-pa | bench-frontend | bench-grpc-client | bench-overhead   (see README.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BUILD ?= build
BACKEND ?= cpu
MODEL ?=
PRESET ?=
# WEIGHTS=int8: the CPU engine's projections in int8 (weight-only, quantized at build time); default float32.
WEIGHTS ?=
# NAME: build a new version of a named model into $(BUILD)/models (several models, rollout and rollback).
NAME ?=
VERSION ?=
KEEP_VERSIONS ?=
# MAX_LORA_RANK=<r> (BACKEND=trtllm): build with the LoRA plugin for adapters up to rank r; LORA_TARGET_MODULES
# (TensorRT-LLM names, space-separated) narrows the modules (default: q/k/v/o/gate/up/down).
MAX_LORA_RANK ?=
LORA_TARGET_MODULES ?=
# Capacity (README, "Long prompts"): MAX_SEQ_LEN (prompt + output tokens of one sequence), MAX_BATCH_SIZE,
# KV_CACHE_TOKENS (CPU: the paged KV cache, shared), MAX_NUM_TOKENS (tokens per engine step); ENGINE_ARGS: any other
# `python -m build_engine` flags, as they are (e.g. ENGINE_ARGS="--dtype bfloat16 --max-input-len 30000").
MAX_SEQ_LEN ?=
MAX_BATCH_SIZE ?=
KV_CACHE_TOKENS ?=
MAX_NUM_TOKENS ?=
ENGINE_ARGS ?=
ENGINE_FLAGS := --backend $(BACKEND) --output-dir $(BUILD) $(if $(MODEL),--model $(MODEL)) $(if $(PRESET),--preset $(PRESET)) $(if $(WEIGHTS),--weights $(WEIGHTS)) \
	$(if $(MAX_SEQ_LEN),--max-seq-len $(MAX_SEQ_LEN)) $(if $(MAX_BATCH_SIZE),--max-batch-size $(MAX_BATCH_SIZE)) \
	$(if $(KV_CACHE_TOKENS),--kv-cache-tokens $(KV_CACHE_TOKENS)) $(if $(MAX_NUM_TOKENS),--max-num-tokens $(MAX_NUM_TOKENS)) $(if $(MAX_LORA_RANK),--max-lora-rank $(MAX_LORA_RANK)) \
	$(if $(LORA_TARGET_MODULES),--lora-target-modules $(LORA_TARGET_MODULES)) $(ENGINE_ARGS)
NAMED_FLAGS := $(if $(NAME),--name $(NAME)) $(if $(KEEP_VERSIONS),--keep-versions $(KEEP_VERSIONS))
# `make serve` serves the named models when there are any, else the one default engine.
NAMED_MODELS := $(wildcard $(BUILD)/models/*/rollout.json)

.PHONY: install codex-cli engine serve rollout rollback test test-deps docs soak bench bench-aiperf bench-guidellm bench-pa bench-frontend bench-grpc-client bench-overhead clean lint

# A venv with every role's pinned dependencies; rebuilt when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	$(PY) -m pip install --quiet -e '.[frontend,engine,dev]'
	touch $@

install: $(VENV)/.installed

engine: install
	$(PY) -m build_engine $(ENGINE_FLAGS) $(NAMED_FLAGS)

# Builds the default demo engine only if none exists (or if MODEL/PRESET asks for another one).
ifeq ($(NAMED_MODELS),)
serve: install
	$(PY) -m build_engine --if-missing $(ENGINE_FLAGS)
	$(PY) -m launcher serve --model-repository $(BUILD)/model_repository --work-dir $(BUILD)
else
serve: install
	$(PY) -m launcher serve --model-repository $(BUILD)/models --work-dir $(BUILD)
endif

# Talk to the running `make serve` (same FRONTEND_PORT): print the version now live.
rollout: install
	@test -n "$(NAME)" || { echo "usage: make rollout NAME=<model> [VERSION=<n>]" >&2; exit 2; }
	$(PY) -m launcher rollout --name $(NAME) $(if $(VERSION),--version $(VERSION)) --work-dir $(BUILD)

rollback: install
	@test -n "$(NAME)" || { echo "usage: make rollback NAME=<model>" >&2; exit 2; }
	$(PY) -m launcher rollback --name $(NAME) --work-dir $(BUILD)

# The browser tests' Chromium (tests/integration/test_console.py): Debian's chromium package, installed once
# (~1-2 min, ~300 MB); Playwright (the dev extra) drives it, and downloads no browser of its own.
test-deps:
	command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; }

test: install codex-cli test-deps
	$(PY) -m pytest -q

# The Codex CLI (tests/integration/test_codex_cli.py runs it against the stack): the pinned npm package, with the
# linux-x64 binary it brings from the registry, in $(BUILD)/codex (git-ignored). Needs Node.js with npm.
CODEX_VERSION := 0.171.0
codex-cli: $(BUILD)/codex/.installed-$(CODEX_VERSION)
$(BUILD)/codex/.installed-$(CODEX_VERSION):
	@command -v npm >/dev/null || { echo "npm not found: install Node.js with npm (the Codex CLI test needs it)" >&2; exit 1; }
	mkdir -p $(BUILD)/codex && npm install --prefix $(BUILD)/codex --no-audit --no-fund --silent \
		@openai/codex@$(CODEX_VERSION) && touch $@

# 32 concurrent streams for 3 minutes (SOAK_SECONDS to change): zero errors, frontend RSS flat; prints figures.
# Also a 30k-token prompt through the long-context engine (tests/integration/test_codex_cli.py, marked slow).
soak: install
	$(PY) -m pytest -q -s -m slow tests/integration/test_soak.py tests/integration/test_codex_cli.py

# Load tests (benchmarks/README.md): raw Triton vs the frontend vs the naive baseline, same workload;
# results in benchmarks/results/<date>[-quick]/. QUICK=1: the short workload (under 2 minutes).
QUICK_FLAG = $(if $(filter-out 0,$(QUICK)),--quick)
bench: install
	$(PY) -m build_engine --if-missing --preset small --output-dir $(BUILD)/bench
	$(PY) -m benchmarks.stack_bench --model-repository $(BUILD)/bench/model_repository --work-dir $(BUILD)/bench $(QUICK_FLAG)

# NVIDIA's AIPerf and GuideLLM (vllm-project) against the same stack with `make bench`'s workload
# (benchmarks/README.md, "AIPerf and GuideLLM"); each pinned, in its own venv under $(BUILD) (never the project's),
# rebuilt when its pin changes. Results next to `make bench`'s: benchmarks/results/<date>[-quick]/<tool>/.
AIPERF_VERSION := 0.13.0
GUIDELLM_VERSION := 0.8.1
$(BUILD)/aiperf-venv/.installed-$(AIPERF_VERSION):
	rm -rf $(BUILD)/aiperf-venv && $(PYTHON) -m venv $(BUILD)/aiperf-venv
	$(BUILD)/aiperf-venv/bin/python -m pip install --quiet --disable-pip-version-check aiperf==$(AIPERF_VERSION)
	touch $@
$(BUILD)/guidellm-venv/.installed-$(GUIDELLM_VERSION):
	rm -rf $(BUILD)/guidellm-venv && $(PYTHON) -m venv $(BUILD)/guidellm-venv
	$(BUILD)/guidellm-venv/bin/python -m pip install --quiet --disable-pip-version-check guidellm==$(GUIDELLM_VERSION)
	touch $@
bench-aiperf: install $(BUILD)/aiperf-venv/.installed-$(AIPERF_VERSION)
bench-guidellm: install $(BUILD)/guidellm-venv/.installed-$(GUIDELLM_VERSION)
bench-aiperf bench-guidellm: bench-%:
	$(PY) -m build_engine --if-missing --preset small --output-dir $(BUILD)/bench
	$(PY) -m benchmarks.external_bench --tool $* --tool-bin $(BUILD)/$*-venv/bin/$* \
		--model-repository $(BUILD)/bench/model_repository --work-dir $(BUILD)/bench $(QUICK_FLAG)

# The frontend's CPU per streamed token, against an engine that costs nothing (benchmarks/README.md, "Frontend
# benchmark"): concurrency 1, 16, 64, 256; results in benchmarks/results/<date>[-quick]/frontend/ (or BENCH_OUT=<dir>).
# QUICK=1: 64-token answers, >= 4k tokens per level (about a minute). FRONTEND_WORKERS=N: the frontend with N workers.
bench-frontend: install
	$(PY) -m build_engine --if-missing --preset tiny --output-dir $(BUILD)/bench-frontend
	$(PY) -m benchmarks.frontend_bench --model-repository $(BUILD)/bench-frontend/model_repository \
		--work-dir $(BUILD)/bench-frontend $(QUICK_FLAG) $(if $(FRONTEND_WORKERS),--frontend-workers $(FRONTEND_WORKERS))

# The gRPC read alone, per message (benchmarks/README.md, "The transport's own floor").
bench-grpc-client: install
	$(PY) -m build_engine --if-missing --preset tiny --output-dir $(BUILD)/bench-frontend
	$(PY) -m benchmarks.grpc_client_bench --model-repository $(BUILD)/bench-frontend/model_repository \
		--work-dir $(BUILD)/bench-frontend

# The overhead-bound stack (benchmarks/README.md, "Overhead-bound stack"): the real stack on the tiny engine, 32
# streaming chats of 64 tokens, tok/s and CPU µs per output token of each process, medians of ROUNDS rounds.
# BASELINE=<another checkout> (e.g. a `git worktree`) runs that checkout's stack too, interleaved (its own tiny build
# in <checkout>/build/bench-overhead). Rebuilt every time: the rendered repository holds a copy of model.py.
ROUNDS ?= 3
BASELINE ?=
bench-overhead: install
	$(PY) -m build_engine --preset tiny --output-dir $(BUILD)/bench-overhead
	$(if $(BASELINE),cd $(BASELINE) && PYTHONPATH=$(abspath $(BASELINE)) $(abspath $(PY)) -m build_engine --if-missing \
		--preset tiny --output-dir $(abspath $(BASELINE))/build/bench-overhead)
	$(PY) -m benchmarks.overhead_bench --model-repository $(BUILD)/bench-overhead/model_repository \
		--work-dir $(BUILD)/bench-overhead --rounds $(ROUNDS) $(if $(BASELINE),--stack baseline=$(abspath $(BASELINE)))

# perf_analyzer 2.51 (installed into $(BUILD)/perf_analyzer, not the venv) streaming gRPC sweep.
bench-pa: install
	$(PY) -m build_engine --if-missing --preset small --output-dir $(BUILD)/bench
	PY=$(PY) PA_DIR=$(abspath $(BUILD))/perf_analyzer bash benchmarks/perf_analyzer/run_sweep.sh \
		--model-repository $(BUILD)/bench/model_repository --work-dir $(BUILD)/bench $(QUICK_FLAG)

# docker/: the compose file must validate against the Compose Specification's JSON schema (vendored, pinned:
# docker/compose-spec/README.md; jsonschema and PyYAML from the venv: nothing is installed on the machine), and
# the Dockerfiles must pass hadolint (pinned in the dev extra). MODEL_DIR, RESPONSES_DB_PASSWORD_FILE and
# RESPONSES_REASONING_KEYS_FILE are only interpolated, never read.
lint: install lint-k8s lint-docs
	MODEL_DIR=/models/hf RESPONSES_DB_PASSWORD_FILE=/run/responses-db.password \
		RESPONSES_REASONING_KEYS_FILE=/run/responses-reasoning.keys $(PY) docker/validate_compose.py docker/compose.yaml
	$(VENV)/bin/hadolint docker/Dockerfile.trtllm docker/Dockerfile.frontend docker/Dockerfile.cpu

# The documentation site (docs/, mkdocs.yml): MkDocs with the Material theme, pinned in docs/requirements.txt and
# installed into their own venv, $(BUILD)/docs-venv (never the project's venv or the machine). `make docs` builds
# it into $(BUILD)/site (git-ignored); `make lint` builds it too, strict: a broken link, a missing page or an
# unknown nav entry fails. The configuration reference's table is generated from frontend/settings.py at each
# build (docs/hooks/site.py runs docs/settings_reference.py with the project's venv).
DOCS_VENV := $(BUILD)/docs-venv
SITE_DIR := $(BUILD)/site

$(DOCS_VENV)/.installed: docs/requirements.txt
	rm -rf $(DOCS_VENV)
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r docs/requirements.txt
	touch $@

.PHONY: lint-docs
docs lint-docs: install $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 TRITONLLM_PYTHON=$(abspath $(PY)) $(DOCS_VENV)/bin/mkdocs build --strict --clean --site-dir $(abspath $(SITE_DIR))
	@echo "docs: $(SITE_DIR)/index.html"

# deploy/kubernetes/, offline: every overlay renders (kubectl's built-in kustomize), every core resource
# validates against the Kubernetes $(K8S_VERSION) schemas (strict: unknown fields fail), and checkov finds
# nothing beyond the skips justified in deploy/kubernetes/.checkov.yaml. The tools live in their own venv,
# pinned by deploy/kubernetes/lint-requirements.txt (checkov's many pins must not move the project's).
K8S_VERSION := 1.33.0
K8S_DIR := deploy/kubernetes
LINT_VENV := $(BUILD)/lint-venv
K8S_RENDERED := $(BUILD)/k8s-rendered

$(LINT_VENV)/.installed: $(K8S_DIR)/lint-requirements.txt $(K8S_DIR)/lint-constraints.txt
	rm -rf $(LINT_VENV)
	$(PYTHON) -m venv $(LINT_VENV)
	cd $(K8S_DIR) && $(abspath $(LINT_VENV))/bin/python -m pip install --quiet --disable-pip-version-check \
		-r lint-requirements.txt
	touch $@

.PHONY: lint-k8s
lint-k8s: $(LINT_VENV)/.installed
	rm -rf $(K8S_RENDERED) && mkdir -p $(K8S_RENDERED)
	for dir in $(K8S_DIR)/overlays/* $(K8S_DIR)/monitoring; do \
		kubectl kustomize "$$dir" > $(K8S_RENDERED)/$$(basename "$$dir").yaml || exit 1; \
	done
	$(LINT_VENV)/bin/python $(K8S_DIR)/validate.py $(K8S_VERSION) $(K8S_RENDERED)/*.yaml
	$(LINT_VENV)/bin/checkov --config-file $(K8S_DIR)/.checkov.yaml --directory $(K8S_RENDERED)

clean:
	rm -rf $(BUILD)

# llama.cpp side by side (benchmarks/README.md, "llama.cpp side by side"). `make llama-cpp`: llama-server and
# llama-quantize built from the llama.cpp that the pinned llama-cpp-python sdist vendors, into $(BUILD)/llama.cpp
# (~10-15 min on 2 cores; benchmarks/llamacpp_build.sh). `make bench-llamacpp`: the `small` engine, float32 and
# int8 (same checkpoint), against llama-server on f32 and q8_0 GGUFs of that checkpoint: streaming chat, 64 tokens,
# concurrency 1 and 16, ROUNDS interleaved rounds; tok/s and CPU µs per token of each process, ratios. The
# llama-server: LLAMA_SERVER=<binary>, else PATH, else `make llama-cpp`'s (built first when there is none).
LLAMA_CPP_DIR := $(BUILD)/llama.cpp
LLAMA_BENCH := $(BUILD)/bench-llamacpp
LLAMA_SERVER ?=
.PHONY: llama-cpp bench-llamacpp
llama-cpp: install
	PY=$(PY) bash benchmarks/llamacpp_build.sh $(LLAMA_CPP_DIR)

bench-llamacpp: install
	PY=$(PY) $(if $(LLAMA_SERVER)$(shell command -v llama-server 2>/dev/null),SOURCE_ONLY=1) \
		bash benchmarks/llamacpp_build.sh $(LLAMA_CPP_DIR)
	$(PY) -m build_engine --if-missing --preset small --output-dir $(LLAMA_BENCH)/float32
	$(PY) -m build_engine --if-missing --model $(LLAMA_BENCH)/float32/checkpoints/demo-small --weights int8 \
		--output-dir $(LLAMA_BENCH)/int8
	$(PY) -m benchmarks.llamacpp_bench --work-dir $(LLAMA_BENCH) --llama-cpp-dir $(LLAMA_CPP_DIR) --rounds $(ROUNDS) \
		--engine float32=$(LLAMA_BENCH)/float32/model_repository --engine int8=$(LLAMA_BENCH)/int8/model_repository \
		$(if $(LLAMA_SERVER),--llama-server $(LLAMA_SERVER))
