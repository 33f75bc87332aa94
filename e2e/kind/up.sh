#!/usr/bin/env bash
# A kind cluster for encoderpool: one node, a host folder shared with it, ready for pods.
# Works offline here (node image assembled by node/image.sh, our own dockerd) and, unchanged,
# on a machine with a registry and the stock node image (KIND_NODE_IMAGE=kindest/node:v1.36.3).
#   e2e/kind/up.sh [name]   (default encoderpool)  -> prints KEY=value lines: KUBECONFIG,
#                           KIND_CLUSTER, KIND_SHARE (the host folder at /var/lib/encoderpool
#                           in the node), KIND_REGISTRY (push here: localhost:<port>; pods pull
#                           the same names), DOCKER_HOST, PATH_PREFIX (kind's docker shim, or empty)
#   e2e/kind/down.sh [name]
# Env: KIND_NODE_IMAGE (default: build it offline), DOCKER_HOST (default: tools/dockerd.sh),
#      KIND (a kind binary; default e2e/kind/build.sh's), KIND_REGISTRY_PORT (5001),
#      ENCODERPOOL_CACHE
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
bin=$("$here/build.sh")
kind=${KIND:-$bin/kind}
. "$here/versions.env"
reg_name=encoderpool-registry reg_port=${KIND_REGISTRY_PORT:-5001}
node_image=${KIND_NODE_IMAGE:-$("$here/node/image.sh")}
# The shim, only where a privileged container cannot start (never on a normal Docker host).
prefix=
if ! docker run --rm --privileged --network none --entrypoint /bin/true "$node_image" >/dev/null 2>&1; then
  step "privileged containers fail here: kind runs through e2e/kind/shim"
  prefix=$here/shim; export PATH=$prefix:$PATH
fi
state=$cache/kind/clusters/$name; share=$state/share; kubeconfig=$state/kubeconfig
mkdir -p "$share"
sed -e "s|NODE_IMAGE|$node_image|" -e "s|SHARE_DIR|$share|" -e "s|REGISTRY_PORT|$reg_port|" \
  -e "s|REGISTRY_NAME|$reg_name|" "$here/cluster.yaml" > "$state/cluster.yaml"
# A cluster left by an earlier run whose node is not running (the engine restarted) is
# deleted and made anew, not reused.
if "$kind" get clusters 2>/dev/null | grep -qx "$name" &&
   [ "$(docker inspect -f '{{.State.Running}}' "$name-control-plane" 2>/dev/null)" != true ]; then
  step "cluster $name is left over and not running: deleting it"
  "$kind" delete cluster --name "$name" >&2
fi
if ! "$kind" get clusters 2>/dev/null | grep -qx "$name"; then
  step "creating cluster $name ($node_image)"
  "$kind" create cluster --name "$name" --config "$state/cluster.yaml" --kubeconfig "$kubeconfig" --wait 5m >&2
else
  "$kind" export kubeconfig --name "$name" --kubeconfig "$kubeconfig" >&2
fi
# The registry: FROM scratch + the binary we built; its data persists under the cache.
if [ "$(docker inspect -f '{{.State.Running}}' "$reg_name" 2>/dev/null)" != true ]; then
  reg_image=encoderpool.local/registry:$REGISTRY_VERSION
  if ! docker image inspect "$reg_image" >/dev/null 2>&1; then
    ctx=$cache/kind/ctx-registry; rm -rf "$ctx"; mkdir -p "$ctx"
    cp "$bin/registry" "$here/registry/config.yml" "$ctx/"; cp -a "$here/node/static-root" "$ctx/root"
    printf 'FROM scratch\nCOPY root/ /\nCOPY registry /registry\nCOPY config.yml /etc/registry.yml\nUSER 65532:65532\nENTRYPOINT ["/registry", "serve", "/etc/registry.yml"]\n' > "$ctx/Dockerfile"
    docker build --network none -q -t "$reg_image" "$ctx" >/dev/null
  fi
  mkdir -p "$cache/kind/registry" && chown 65532:65532 "$cache/kind/registry" 2>/dev/null || true
  docker rm -f "$reg_name" >/dev/null 2>&1 || true
  docker run -d --name "$reg_name" --network kind -p "127.0.0.1:$reg_port:5000" \
    -v "$cache/kind/registry:/var/lib/registry" "$reg_image" >/dev/null
  step "registry $reg_name on 127.0.0.1:$reg_port (data in $cache/kind/registry)"
fi
# Pushes right after a start met a registry not yet listening ("EOF"): wait for /v2/.
for _ in $(seq 1 60); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$reg_port/v2/', timeout=2)" 2>/dev/null && break
  sleep 0.5
done
step "cluster $name ready in $(( $(date +%s) - t0 )) s"
echo "KUBECONFIG=$kubeconfig"
echo "KIND_CLUSTER=$name"
echo "KIND_SHARE=$share"
echo "KIND_REGISTRY=localhost:$reg_port"
echo "DOCKER_HOST=${DOCKER_HOST:-}"
echo "PATH_PREFIX=$prefix"
