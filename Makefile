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
export PYTHONPATH := $(CURDIR)/contracts:$(CURDIR)/operator:$(CURDIR)/connector:$(CURDIR)/router:$(CURDIR)
PYTEST_ARGS ?=
# The static checks that gate the tests (tests/test_checks_gate.py swaps in `false`).
CHECKS ?= tools/checks.sh
# e.g. make demo DEMO_ARGS="--transport rdma"
DEMO_ARGS ?=

.PHONY: help venv cluster-bin prepare lint crds test demo demo-local gpu-image clean-cache
help:
	@echo "make demo       - the pool as users run it: kind, images, the chart, a sample EncoderPool, a request"
	@echo "make demo-local - the same without Docker: local control plane, pods as local processes"
	@echo "make test       - everything: lint, types, unit tests, real vLLM, real control plane, kind"
	@echo "make lint       - ruff, ruff format, mypy, import rules (the gate of make test)"
	@echo "make crds       - regenerate crds/, the chart's generated files and docs/api.md's tables from the pydantic models"
	@echo "make gpu-image  - the GPU image (vLLM 0.34 for CUDA + the connector) built offline and checked in it"

venv:
	@tools/venv.sh >/dev/null

cluster-bin:
	@e2e/cluster/build.sh >/dev/null

lint: venv
	@tools/checks.sh

crds: venv
	@V=$$(tools/venv.sh); $$V/bin/python -m encoderpool_codegen.crd crds/ && \
	  $$V/bin/python -m encoderpool_codegen.chart charts/encoderpool-operator && \
	  $$V/bin/python -m encoderpool_codegen.apidoc docs/api.md

# Everything the tests build or download, network and CPU work side by side (cached).
prepare:
	@tools/prepare.sh

# The checks gate the tests: `&&`, and the recipe shell runs with -e -o pipefail.
test: prepare
	@$(CHECKS) && V=$$(tools/venv.sh) && export ENCODERPOOL_BIN=$$(e2e/cluster/build.sh) && \
	  tools/test.sh $$V/bin/python $(PYTEST_ARGS)

# Where Docker can run (installed if missing): kind, the images, the chart, a pool, a request.
# Elsewhere use demo-local.
demo: venv cluster-bin
	@V=$$(tools/venv.sh); export ENCODERPOOL_BIN=$$(e2e/cluster/build.sh); \
	  $$V/bin/python -m e2e.kind.demo $(DEMO_ARGS)

demo-local: venv cluster-bin
	@V=$$(tools/venv.sh); export ENCODERPOOL_BIN=$$(e2e/cluster/build.sh); \
	  $$V/bin/python -m e2e.demo $(DEMO_ARGS)

# Not in make test: 4 GB of wheels and a 10 GB image (docs/install.md#the-gpu-image).
gpu-image: venv
	@export DOCKER_HOST=$${DOCKER_HOST:-$$(tools/dockerd.sh start | tail -1)}; \
	  img=$$(docker/build.sh --gpu | sed -n 's/^VLLM_GPU_IMAGE=//p') && \
	  docker/check-gpu-image.sh "$$img" && echo "VLLM_GPU_IMAGE=$$img"

clean-cache:
	rm -rf $(ENCODERPOOL_CACHE)
