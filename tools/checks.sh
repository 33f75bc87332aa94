#!/usr/bin/env bash
# The static checks `make test` runs before any test: ruff, ruff format, mypy, the import
# rules. Any failure
# stops here with a non-zero exit, so `make test` (and .ci/run) fails on it.
#   tools/checks.sh [project-dir]   (default: this repository; the dir's pyproject.toml
#                                    configures all three tools)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
V=${VENV:-$("$root/tools/venv.sh")}
cd "${1:-$root}"
fail=0
"$V/bin/ruff" check . || { echo "checks: ruff check failed" >&2; fail=1; }
"$V/bin/ruff" format --check . || { echo "checks: ruff format --check failed (run: ruff format .)" >&2; fail=1; }
# mypy's cache beside the venv it was made with, not in the checkout: a fresh clone then
# re-checks only the project's own modules, not torch's and vLLM's (most of a cold run).
export MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-$(dirname "$(dirname "$V")")/mypy/$(basename "$V")}
"$V/bin/mypy" || { echo "checks: mypy failed" >&2; fail=1; }
# The cut between the three images (docs/architecture.md): who may import whom.
"$V/bin/python" "$root/tools/import_rules.py" . || { echo "checks: import rules failed" >&2; fail=1; }
exit $fail
