#!/usr/bin/env bash
# A kind cluster for encoderpool: one node, a host folder shared with it, ready for pods.
# Works offline here (node image assembled by node/image.sh, our own dockerd) and, unchanged,
# on a machine with a registry and the stock node image (KIND_NODE_IMAGE=kindest/node:v1.36.3).
#   e2e/kind/up.sh [name]   (default encoderpool)  -> prints KEY=value lines: KUBECONFIG,
#                           KIND_CLUSTER, KIND_SHARE (the host folder at /var/lib/encoderpool
#                           in the node), DOCKER_HOST, PATH_PREFIX (kind's docker shim, or empty)
#   e2e/kind/down.sh [name]
# Env: KIND_NODE_IMAGE (default: build it offline), DOCKER_HOST (default: tools/dockerd.sh),
#      KIND (a kind binary; default e2e/kind/build.sh's), ENCODERPOOL_CACHE
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script too
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
name=${1:-encoderpool}
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
step() { echo "kind/up.sh: $*" >&2; }
t0=$(date +%s)
if [ -z "${DOCKER_HOST:-}" ] && ! docker version >/dev/null 2>&1; then DOCKER_HOST=$("$root/tools/dockerd.sh" start); fi
export DOCKER_HOST=${DOCKER_HOST:-}
[ -n "$DOCKER_HOST" ] || unset DOCKER_HOST
kind=${KIND:-$("$here/build.sh")/kind}
node_image=${KIND_NODE_IMAGE:-$("$here/node/image.sh")}
# The shim, only where a privileged container cannot start (never on a normal Docker host).
prefix=
if ! docker run --rm --privileged --network none --entrypoint /bin/true "$node_image" >/dev/null 2>&1; then
  step "privileged containers fail here: kind runs through e2e/kind/shim"
  prefix=$here/shim; export PATH=$prefix:$PATH
fi
state=$cache/kind/clusters/$name; share=$state/share; kubeconfig=$state/kubeconfig
mkdir -p "$share"
sed -e "s|NODE_IMAGE|$node_image|" -e "s|SHARE_DIR|$share|" "$here/cluster.yaml" > "$state/cluster.yaml"
if ! "$kind" get clusters 2>/dev/null | grep -qx "$name"; then
  step "creating cluster $name ($node_image)"
  "$kind" create cluster --name "$name" --config "$state/cluster.yaml" --kubeconfig "$kubeconfig" --wait 5m >&2
else
  "$kind" export kubeconfig --name "$name" --kubeconfig "$kubeconfig" >&2
fi
step "cluster $name ready in $(( $(date +%s) - t0 )) s"
echo "KUBECONFIG=$kubeconfig"
echo "KIND_CLUSTER=$name"
echo "KIND_SHARE=$share"
echo "DOCKER_HOST=${DOCKER_HOST:-}"
echo "PATH_PREFIX=$prefix"
