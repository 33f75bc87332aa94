#!/usr/bin/env bash
# Check the GPU image (docker/build.sh --gpu) as far as a machine without a GPU can: its
# CUDA kernels never run here, but everything of ours that meets its vLLM does.
#   docker/check-gpu-image.sh IMAGE
# 1. the connector's classes, the width program and the middlewares import from the image's
#    own install (no source mounted), under the image's vLLM, as uid 1000;
# 2. `vllm serve --help` starts;
# 3. in the image, against its vLLM, with the repository mounted read-only: the contract
#    tests (the base-class methods and vLLM internals the connector uses), the operator's
#    rendered `vllm serve` and width-Job command lines read by vLLM's own parser, the
#    router's content-part and API agreement tests, and the connector's unit suite.
# pytest is not in the image: its wheels (the CPU lock's pins, hash-checked) are unpacked
# once into the cache and mounted read-only.
# Env: DOCKER_HOST (tools/dockerd.sh start), ENCODERPOOL_CACHE.
set -euo pipefail
img=${1:?usage: docker/check-gpu-image.sh IMAGE (docker/build.sh --gpu prints it)}
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
: "${DOCKER_HOST:?DOCKER_HOST: the engine tools/dockerd.sh started}"
log() { echo "check-gpu-image.sh: $*" >&2; }
venv=$("$root/tools/venv.sh")

pins=$(grep -A1 -E '^(pytest|pytest-timeout|pluggy|iniconfig)==' "$root/requirements/lock.txt" | grep -v '^--$')
site=$cache/gpu-check/$(echo "$pins" | sha256sum | cut -c1-12)
if [ ! -f "$site/.complete" ]; then
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
  echo "$pins" > "$work/req.txt"
  "$venv/bin/python" -m pip download --disable-pip-version-check -q --no-deps \
    --require-hashes --only-binary=:all: -r "$work/req.txt" -d "$work/wheels"
  rm -rf "$site"; mkdir -p "$site"
  for w in "$work"/wheels/*.whl; do "$venv/bin/python" -m zipfile -e "$w" "$site"; done
  touch "$site/.complete"
fi

# VLLM_TARGET_DEVICE=cpu: without a GPU, vLLM's CUDA build cannot infer a device and
# refuses to build its argument parser; on a GPU node it finds CUDA itself.
run() {  # args for python in the image, as the pods run it (uid 1000, no network)
  docker run --rm --network none --user 1000:1000 -e HOME=/tmp -e PYTHONDONTWRITEBYTECODE=1 \
    -e HF_HUB_OFFLINE=1 -e VLLM_TARGET_DEVICE=cpu --entrypoint python "$@"
}

log "1/3 our modules import from the image's install"
run "$img" -c '
import importlib, sys
import vllm, torch
from encoderpool_contracts.pod import (
    API_GUARD_MIDDLEWARE, CONNECTOR_CLASSES, MEASURE_MODULE, VOLUME_METRICS_MIDDLEWARE)
for name, module in CONNECTOR_CLASSES.values():
    getattr(importlib.import_module(module), name)
for path in (API_GUARD_MIDDLEWARE, VOLUME_METRICS_MIDDLEWARE):
    module, _, name = path.rpartition(".")
    getattr(importlib.import_module(module), name)
importlib.import_module(MEASURE_MODULE)
print(f"vllm {vllm.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"{len(CONNECTOR_CLASSES)} connector classes")
'
run "$img" -m encoderpool_connector.programs.measure --help >/dev/null  # MEASURE_MODULE

log "2/3 vllm serve --help"
docker run --rm --network none --user 1000:1000 -e HOME=/tmp -e VLLM_TARGET_DEVICE=cpu \
  "$img" --help >/dev/null

log "3/3 the contract, parser and unit tests against the image's vLLM"
# As tests/contracts/test_vllm_releases.py runs a release: the tests check that the vLLM
# they import is the one named. The rdma tests register buffers in /dev/shm (a pod's is a
# memory emptyDir): more than Docker's 64 MiB default.
version=$(sed -n -E 's/^vllm==([^ ]+) .*/\1/p' "$root/requirements/vllm-gpu-lock.txt")
run -v "$root:/src:ro" -v "$site:/pytest:ro" -w /src --shm-size 1g \
  -e ENCODERPOOL_VLLM_RELEASE="$version" \
  -e ENCODERPOOL_VLLM_RELEASE_DIR=/opt/vllm/lib/python3.11/site-packages \
  -e PYTHONPATH=contracts:operator:connector:router:.:/pytest "$img" \
  -m pytest -p no:cacheprovider -q -m "not vllm and not kind and not cluster and not alone" \
  tests/contracts/test_vllm_api.py tests/operator/test_vllm_serve_parser.py \
  tests/router/test_content_vllm.py tests/router/test_apis_vllm.py tests/connector
log "passed: $img"
