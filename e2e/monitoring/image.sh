#!/usr/bin/env bash
# Package e2e/monitoring/build.sh's binaries into one image, tagged by their content, so a
# second run builds nothing. Prints MONITORING_IMAGE=<ref>.
# Env: DOCKER_HOST (tools/dockerd.sh start), ENCODERPOOL_CACHE.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${DOCKER_HOST:?DOCKER_HOST: the engine tools/dockerd.sh started}"
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
bin=$("$here/build.sh" | tail -1)
key=$( { cat "$here/Dockerfile"; sha256sum "$bin/prometheus" "$bin/keda" "$bin/keda-adapter" | cut -c1-64; } | sha256sum | cut -c1-12)
image=encoderpool.local/monitoring:$key
if ! /usr/bin/docker image inspect "$image" >/dev/null 2>&1; then
  ctx=$cache/images/ctx/monitoring
  rm -rf "$ctx"; mkdir -p "$ctx/bin" "$ctx/rootfs/etc" "$ctx/rootfs/tmp" "$ctx/rootfs/data"
  cp -l "$bin/prometheus" "$bin/keda" "$bin/keda-adapter" "$ctx/bin/" 2>/dev/null || cp "$bin/prometheus" "$bin/keda" "$bin/keda-adapter" "$ctx/bin/"
  cp "$here/Dockerfile" "$ctx/"
  printf 'root:x:0:0:root:/:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$ctx/rootfs/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' > "$ctx/rootfs/etc/group"
  chmod 1777 "$ctx/rootfs/tmp"; chown 65532:65532 "$ctx/rootfs/data"
  /usr/bin/docker build --network none -q -t "$image" "$ctx" >/dev/null
  /usr/bin/docker images --format '{{.Repository}}:{{.Tag}}' encoderpool.local/monitoring | grep -vxF "$image" | xargs -r /usr/bin/docker rmi >/dev/null 2>&1 || true
fi
echo "MONITORING_IMAGE=$image"
