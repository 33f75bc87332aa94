#!/usr/bin/env bash
# Build what a kind cluster needs that is not a container image, from the Go module proxy,
# into a versioned cache outside the repo (a second run costs nothing):
#   kind (sigs.k8s.io/kind), kubelet, kubeadm, kube-proxy (k8s.io/kubernetes, the same
#   wrapper module e2e/cluster/build.sh prepares), crictl (cri-tools), coredns, pause (C),
#   registry (distribution: the local registry the node pulls our images from).
# Usage: e2e/kind/build.sh   -> prints the bin dir on its last line
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script too
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
. "$root/e2e/cluster/versions.env"
. "$here/versions.env"
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
out="$cache/bin/kind-$KIND_VERSION-k8s-$K8S_VERSION-crictl-$CRICTL_VERSION-coredns-$COREDNS_VERSION-pause-$PAUSE_VERSION-registry-$REGISTRY_VERSION"
want=(kind kubelet kubeadm kube-proxy crictl coredns pause registry)
have_all() { for b in "${want[@]}"; do [ -x "$out/$b" ] || return 1; done; }
if have_all; then echo "$out"; exit 0; fi
log() { echo "kind/build.sh: $*" >&2; }
mkdir -p "$out"
export CGO_ENABLED=0 GOTOOLCHAIN=local
gomod_dir() { GOFLAGS=-mod=mod go mod download -json "$1" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])'; }

# kubelet, kubeadm, kube-proxy: upstream's main packages (a few lines each, taken from the
# k8s.io/kubernetes module at build time) inside the control plane's wrapper module, so the
# packages they share with kube-apiserver come from Go's build cache.
build_node_k8s() {
  local cp w src minor X C ldf
  cp=$("$root/e2e/cluster/build.sh")  # prepares the wrapper module (and the control plane)
  w="$cache/src/k8s-$K8S_VERSION"; cd "$w"
  src=$(gomod_dir "k8s.io/kubernetes@v$K8S_VERSION")
  for c in kubelet kubeadm kube-proxy; do
    mkdir -p "node/$c"
    case $c in kube-proxy) f=proxy.go ;; *) f=$c.go ;; esac
    install -m 0644 "$src/cmd/$c/$f" "node/$c/main.go"
  done
  GOFLAGS=-mod=mod go mod tidy
  minor=$(cut -d. -f2 <<<"$K8S_VERSION")
  X=k8s.io/component-base/version C=k8s.io/client-go/pkg/version
  ldf="-s -w -X $X.gitVersion=v$K8S_VERSION -X $X.gitMajor=1 -X $X.gitMinor=$minor -X $X.gitTreeState=clean -X $C.gitVersion=v$K8S_VERSION -X $C.gitMajor=1 -X $C.gitMinor=$minor"
  GOFLAGS=-mod=mod nice -n 10 go build -trimpath -ldflags "$ldf" -o "$out/" ./node/kubelet ./node/kubeadm ./node/kube-proxy
  : "$cp"
}

[ -x "$out/kind" ] || { log "building kind v$KIND_VERSION"; GOBIN=$out nice -n 10 go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@v$KIND_VERSION"; }
[ -x "$out/crictl" ] || { log "building crictl v$CRICTL_VERSION"; GOBIN=$out nice -n 10 go install -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=v$CRICTL_VERSION" "sigs.k8s.io/cri-tools/cmd/crictl@v$CRICTL_VERSION"; }
[ -x "$out/coredns" ] || { log "building coredns v$COREDNS_VERSION"; GOBIN=$out nice -n 10 go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@v$COREDNS_VERSION"; }
[ -x "$out/registry" ] || { log "building registry v$REGISTRY_VERSION"; GOBIN=$out nice -n 10 go install -trimpath -ldflags "-s -w" "github.com/distribution/distribution/v3/cmd/registry@v$REGISTRY_VERSION"; }
if [ ! -x "$out/pause" ]; then  # the sandbox image's one binary: upstream's pause.c, static
  src=$(gomod_dir "k8s.io/kubernetes@v$K8S_VERSION")/build/pause/linux/pause.c
  gcc -Os -static -DVERSION="v$PAUSE_VERSION" -o "$out/pause.tmp" "$src" && strip "$out/pause.tmp" && mv "$out/pause.tmp" "$out/pause"
fi
[ -x "$out/kubelet" ] && [ -x "$out/kubeadm" ] && [ -x "$out/kube-proxy" ] || { log "building kubelet, kubeadm, kube-proxy v$K8S_VERSION"; (build_node_k8s); }
have_all || { log "some binaries are missing from $out"; exit 1; }
echo "$out"
