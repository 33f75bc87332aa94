#!/usr/bin/env bash
# make test's pytest run. With no arguments: the kind suite (real containers) in a second
# pytest process beside everything else. Its cluster's creation, image pushes and pod
# starts leave a core idle much of the time, which the other suite's tests fill (two
# cores: serially the two take ~30 min, side by side ~22). Its output is printed after
# the main suite's; either failing fails the run. With arguments: one pytest, as given.
#   tools/test.sh PYTHON [PYTEST_ARGS...]
set -euo pipefail
py=$1; shift
if [ $# -gt 0 ]; then exec "$py" -m pytest "$@"; fi
log=$(mktemp -t encoderpool-kind-tests.XXXXXX)
"$py" -m pytest -m kind -p no:cacheprovider >"$log" 2>&1 & kind=$!
# Interrupted: stop the kind suite too (by its PID), and keep no log behind.
trap 'kill -TERM $kind 2>/dev/null || true' INT TERM
trap 'rm -f "$log"' EXIT
rc=0; "$py" -m pytest -m "not kind" || rc=$?
krc=0; wait $kind || krc=$?
echo "================ the kind suite (a second pytest process, run alongside) ================"
cat "$log"
echo "tools/test.sh: main suite exit $rc, kind suite exit $krc" >&2
[ $rc = 0 ] && [ $krc = 0 ]
