#!/usr/bin/env bash
# Delete the kind cluster e2e/kind/up.sh made (its images stay in the local docker).
set -euo pipefail
kind delete cluster --name "${KIND_CLUSTER:-encoderpool}"
