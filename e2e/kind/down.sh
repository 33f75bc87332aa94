#!/usr/bin/env bash
# Delete a kind cluster e2e/kind/up.sh made (by name) and its state folder; images are kept.
#   e2e/kind/down.sh [name]   (default encoderpool)
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script too
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
name=${1:-encoderpool}
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
if [ -z "${DOCKER_HOST:-}" ] && ! docker version >/dev/null 2>&1; then DOCKER_HOST=$("$root/tools/dockerd.sh" host); export DOCKER_HOST; fi
kind=${KIND:-$("$here/build.sh")/kind}
state=$cache/kind/clusters/$name
"$kind" delete cluster --name "$name" --kubeconfig "$state/kubeconfig" >&2
# The last cluster gone: stop the registry too (its data stays in the cache).
[ -n "$("$kind" get clusters 2>/dev/null)" ] || docker rm -f encoderpool-registry >/dev/null 2>&1 || true
# The node wrote into the shared folder as root: remove it the same way.
rm -rf "$state"
