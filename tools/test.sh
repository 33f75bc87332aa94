#!/usr/bin/env bash
# make test's pytest run. With no arguments: the kind suite (real containers) in a second
# pytest process beside everything else. Its cluster's creation, image pushes and pod
# starts leave a core idle much of the time, which the other suite's tests fill (two
# cores: serially the two take ~30 min, side by side ~22). Its output is printed after
# the main suite's. Tests marked `alone` run last, by themselves: they time threads that
# starve when the kind suite's cluster shares the two cores. Any of the three failing
# fails the run. With arguments: one pytest, as given.
#   tools/test.sh PYTHON [PYTEST_ARGS...]
set -euo pipefail
py=$1; shift
if [ $# -gt 0 ]; then exec "$py" -m pytest "$@"; fi
log=$(mktemp -t encoderpool-kind-tests.XXXXXX)
"$py" -m pytest -m kind -p no:cacheprovider >"$log" 2>&1 & kind=$!
# Interrupted: stop the kind suite too (by its PID), and keep no log behind.
trap 'kill -TERM $kind 2>/dev/null || true' INT TERM
trap 'rm -f "$log"' EXIT
rc=0; "$py" -m pytest -m "not kind and not alone" || rc=$?
krc=0; wait $kind || krc=$?
echo "================ the kind suite (a second pytest process, run alongside) ================"
cat "$log"
echo "================ tests that need the cores to themselves (marked alone) ================"
arc=0; "$py" -m pytest -m alone -p no:cacheprovider || arc=$?
echo "tools/test.sh: main suite exit $rc, kind suite exit $krc, alone exit $arc" >&2
[ $rc = 0 ] && [ $krc = 0 ] && [ $arc = 0 ]
