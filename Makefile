# encoderpool: the two commands a newcomer needs are `make demo` and `make test`.
# Heavy things (the ~5 GB venv, the Go-built control plane) are cached under
# $(ENCODERPOOL_CACHE), outside the repo, so the second run is fast.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
export ENCODERPOOL_CACHE ?= $(HOME)/.cache/encoderpool
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export VLLM_TARGET_DEVICE := cpu
export PYTHONPATH := $(CURDIR)/operator:$(CURDIR)/connector:$(CURDIR)
PYTEST_ARGS ?=
# e.g. make demo DEMO_ARGS="--transport rdma"
DEMO_ARGS ?=

.PHONY: help venv cluster-bin lint crds test demo clean-cache
help:
	@echo "make demo   - local demo: control plane, operator, a sample EncoderPool, one request answered through the pool"
	@echo "make test   - everything: lint, types, unit tests, real vLLM, real control plane"
	@echo "make lint   - ruff + mypy"
	@echo "make crds   - regenerate crds/ and the chart's generated files from the pydantic models"

venv:
	@tools/venv.sh >/dev/null

cluster-bin:
	@e2e/cluster/build.sh >/dev/null

lint: venv
	@V=$$(tools/venv.sh); $$V/bin/ruff check . && $$V/bin/ruff format --check . && $$V/bin/mypy

crds: venv
	@V=$$(tools/venv.sh); $$V/bin/python -m encoderpool_codegen.crd crds/ && \
	  $$V/bin/python -m encoderpool_codegen.chart charts/encoderpool-operator

test: venv cluster-bin
	@V=$$(tools/venv.sh); export ENCODERPOOL_BIN=$$(e2e/cluster/build.sh); \
	  $$V/bin/ruff check . && $$V/bin/ruff format --check . && $$V/bin/mypy; \
	  $$V/bin/python -m pytest $(PYTEST_ARGS)

demo: venv cluster-bin
	@V=$$(tools/venv.sh); export ENCODERPOOL_BIN=$$(e2e/cluster/build.sh); \
	  $$V/bin/python -m e2e.demo $(DEMO_ARGS)

clean-cache:
	rm -rf $(ENCODERPOOL_CACHE)
