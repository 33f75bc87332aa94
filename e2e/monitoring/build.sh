#!/usr/bin/env bash
# Build the test bed's monitoring and autoscaling parts from the Go module proxy into a
# cache outside the repo, keyed by their versions and the Go version, so a second run
# costs nothing:
#   prometheus, promtool  (github.com/prometheus/prometheus: the v3 server, and the tool whose
#                         `test rules` unit-tests the chart's alerts)
#   keda, keda-adapter    (github.com/kedacore/keda/v2: operator and metrics API server)
#   kstatus               (a small CLI around sigs.k8s.io/cli-utils' kstatus, Flux's health library)
# Usage: e2e/monitoring/build.sh   -> prints the bin dir on its last line
# Env:   ENCODERPOOL_CACHE (default ~/.cache/encoderpool)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
command -v go >/dev/null || { echo "build.sh: Go is required (https://go.dev/dl), not found on PATH" >&2; exit 1; }
export CGO_ENABLED=0 GOTOOLCHAIN=local GOWORK=off
gover=$(go env GOVERSION)
key="prometheus-$PROMETHEUS_VERSION-keda-$KEDA_VERSION-cliutils-$CLI_UTILS_VERSION-$gover"
out="$cache/bin/$key"
want=(prometheus promtool keda keda-adapter kstatus)

have_all() { for b in "${want[@]}"; do [ -x "$out/$b" ] || return 1; done; }
if have_all; then echo "$out"; exit 0; fi
mkdir -p "$cache/bin"
exec 9>"$cache/bin/.monitoring-build.lock"
flock 9
if have_all; then echo "$out"; exit 0; fi
mkdir -p "$out"
log() { echo "monitoring/build.sh: $*" >&2; }

# A module's own directory keeps its replace directives (KEDA has some), which
# `go install MODULE@VERSION` refuses; the module cache is read-only, so build in a copy.
module_copy() {  # module version -> prints a writable copy of the module's tree
  local dir w
  dir=$(go mod download -json "$1@v$2" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')
  w="$cache/src/$(basename "$1")-$2"
  if [ ! -f "$w/.copied" ]; then
    rm -rf "$w" && mkdir -p "$w" && cp -r "$dir/." "$w/" && chmod -R u+w "$w" && touch "$w/.copied"
  fi
  echo "$w"
}

build_prometheus() {
  local w; w=$(module_copy github.com/prometheus/prometheus "$PROMETHEUS_VERSION")
  cd "$w"
  local V=github.com/prometheus/common/version
  # The web UI's assets are not in the module: the server and its API run without them.
  # Only the Kubernetes service discovery: the test bed needs no cloud SDKs (a third of the build).
  GOFLAGS=-mod=mod go build -trimpath -tags remove_all_sd,enable_kubernetes_sd \
    -ldflags "-s -w -X $V.Version=$PROMETHEUS_VERSION" -o "$out/prometheus" ./cmd/prometheus
}

build_promtool() {  # after the server: most of its packages are then in Go's build cache
  local w; w=$(module_copy github.com/prometheus/prometheus "$PROMETHEUS_VERSION")
  cd "$w"
  local V=github.com/prometheus/common/version
  GOFLAGS=-mod=mod go build -trimpath -tags remove_all_sd,enable_kubernetes_sd \
    -ldflags "-s -w -X $V.Version=$PROMETHEUS_VERSION" -o "$out/promtool" ./cmd/promtool
}

build_keda() {
  local w; w=$(module_copy github.com/kedacore/keda/v2 "$KEDA_VERSION")
  cd "$w"
  local V=github.com/kedacore/keda/v2/version
  GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w -X $V.Version=$KEDA_VERSION" -o "$out/keda" ./cmd/operator
  GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w -X $V.Version=$KEDA_VERSION" -o "$out/keda-adapter" ./cmd/adapter
}

build_kstatus() {
  local w="$cache/src/kstatus-$CLI_UTILS_VERSION"
  mkdir -p "$w" && cp "$here/kstatus/main.go" "$w/main.go" && cd "$w"
  [ -f go.mod ] || go mod init local.build/kstatus >/dev/null 2>&1
  GOFLAGS=-mod=mod go get "sigs.k8s.io/cli-utils@v$CLI_UTILS_VERSION"
  GOFLAGS=-mod=mod go mod tidy
  GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$out/kstatus" .
}

[ -x "$out/kstatus" ] || { log "building kstatus (cli-utils v$CLI_UTILS_VERSION)"; (build_kstatus); }
[ -x "$out/prometheus" ] || { log "building Prometheus v$PROMETHEUS_VERSION (10-25 min cold on 2 cores)"; (build_prometheus); }
[ -x "$out/promtool" ] || { log "building promtool v$PROMETHEUS_VERSION"; (build_promtool); }
[ -x "$out/keda" ] && [ -x "$out/keda-adapter" ] || { log "building KEDA v$KEDA_VERSION (20-40 min cold on 2 cores)"; (build_keda); }
have_all || { log "some binaries are missing from $out"; exit 1; }
echo "$out"
