#!/usr/bin/env bash
# Build or fetch everything `make test` needs, in two lanes at once, so a cold machine
# spends its network time and its CPU time side by side instead of one after the other:
#   network lane: the venv, the vLLM releases checked by contract, the image wheelhouses
#                 and Debian base, the kind node's rootfs
#   CPU lane:     the local control plane's binaries, then kind's, then the monitoring
#                 test bed's (Prometheus, KEDA, kstatus; all Go)
# Each step is cached by content outside the repo: a warm run returns in seconds. Logs of
# each lane go to $ENCODERPOOL_CACHE/prepare-*.log; a failed lane fails this script and
# prints its log's tail.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
mkdir -p "$cache"
t0=$(date +%s)

network() {
  "$root/tools/venv.sh" >/dev/null
  "$root/tools/vllm-releases.sh" >/dev/null
  "$root/docker/build.sh" --fetch
  "$root/e2e/kind/node/image.sh" --fetch
}
cpu() {
  "$root/e2e/cluster/build.sh" >/dev/null
  "$root/e2e/kind/build.sh" >/dev/null
  "$root/e2e/monitoring/build.sh" >/dev/null
}

network >"$cache/prepare-network.log" 2>&1 & net=$!
cpu >"$cache/prepare-cpu.log" 2>&1 & cpu_pid=$!
fail=0
wait $net || { echo "prepare.sh: the network lane failed:" >&2; tail -30 "$cache/prepare-network.log" >&2; fail=1; }
wait $cpu_pid || { echo "prepare.sh: the CPU lane failed:" >&2; tail -30 "$cache/prepare-cpu.log" >&2; fail=1; }
[ $fail = 0 ] && echo "prepare.sh: ready in $(( $(date +%s) - t0 )) s" >&2
exit $fail
