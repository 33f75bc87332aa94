#!/usr/bin/env bash
# Assemble the kind node image offline (what `kind build node-image` makes from kindest/base),
# cached by content: the tag is a hash of everything that goes in, so a second run is a no-op.
#   1. kind's own node files, from the sigs.k8s.io/kind module we build kind from (never
#      vendored), plus our adaptations (kind-base-files.patch: Debian's containerd/runc/CNI
#      paths, a static bridge CNI instead of kindnetd, an entrypoint that remounts cgroups
#      read-write and shields host-global sysctls from the kubelet)
#   2. a Debian root filesystem with systemd and containerd (mmdebstrap), imported
#   3. the control-plane images kubeadm asks for, FROM scratch + our binaries, exact tags
#   4. kubeadm/kubelet/kubectl/crictl + those images preloaded in the node's containerd
# Usage: e2e/kind/node/image.sh   -> prints the node image's name on its last line
#        e2e/kind/node/image.sh --fetch   only steps 1 and 2 (downloads, no engine needed)
# Env: DOCKER_HOST (tools/dockerd.sh start), ENCODERPOOL_CACHE
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script too
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
. "$root/e2e/cluster/versions.env"
. "$here/../versions.env"
fetch=0; [ "${1:-}" = --fetch ] && fetch=1
[ $fetch = 1 ] || : "${DOCKER_HOST:?DOCKER_HOST: the engine tools/dockerd.sh started}"
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
work=$cache/kind; mkdir -p "$work"
docker() { /usr/bin/docker "$@"; }
log() { echo "node/image.sh: $*" >&2; }
pkgs=systemd,systemd-sysv,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,bash,ca-certificates,curl,jq,procps,containerd,runc,containernetworking-plugins,socat,e2fsprogs,iputils-ping
t0=$(date +%s)

# 1. kind's base files + our patch
overlay_key=$( { echo "$KIND_VERSION exec-bits"; cat "$here/kind-base-files.patch"; } | sha256sum | cut -c1-12)
overlay=$work/overlay-$overlay_key
if [ ! -d "$overlay" ]; then
  src=$(GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/kind@v$KIND_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')
  rm -rf "$overlay.tmp"; mkdir -p "$overlay.tmp"
  cp -a "$src/images/base/files/." "$overlay.tmp/"; chmod -R u+w "$overlay.tmp"
  (cd "$overlay.tmp" && patch -p1 --no-backup-if-mismatch -s < "$here/kind-base-files.patch")
  # files from the module cache are read-only, without exec bits
  chmod 0755 "$overlay.tmp/usr/local/bin/entrypoint" "$overlay.tmp/kind" "$overlay.tmp/kind/bin" "$overlay.tmp"/kind/bin/*.sh
  mv "$overlay.tmp" "$overlay"
fi

# 2. the Debian root filesystem (the expensive part: only when its inputs change)
rootfs_key=$( { echo "$pkgs $DEBIAN_SUITE"; cat "$here/kind-base-files.patch"; sed -n '/^# rootfs:/,/^# end rootfs/p' "$0"; } | sha256sum | cut -c1-12)
rootfs=$work/rootfs-$rootfs_key.tar
[ -f "$rootfs" ] || "$root/tools/apt.sh" mmdebstrap
# rootfs:
if [ ! -f "$rootfs" ]; then
  log "mmdebstrap $DEBIAN_SUITE (1-2 min)"
  nice -n 10 mmdebstrap --quiet --variant=minbase --include="$pkgs" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook="cp -a '$overlay/.' \"\$1/\"" \
    --customize-hook='chmod 0755 "$1"/usr/local/bin/entrypoint "$1"/kind "$1"/kind/bin "$1"/kind/bin/*.sh' \
    --customize-hook='mkdir -p "$1"/opt/cni/bin && for p in "$1"/usr/lib/cni/*; do ln -sf /usr/lib/cni/$(basename $p) "$1"/opt/cni/bin/; done' \
    --customize-hook='chroot "$1" sh -c "ctr oci spec | jq \".hooks.createContainer[.hooks.createContainer|length] |= . + {\\\"path\\\": \\\"/kind/bin/mount-product-files.sh\\\"} | del(.process.rlimits)\" > /etc/containerd/cri-base.json"' \
    --customize-hook='find "$1"/lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete; rm -f "$1"/lib/systemd/system/multi-user.target.wants/* "$1"/etc/systemd/system/*.wants/* "$1"/lib/systemd/system/local-fs.target.wants/* "$1"/lib/systemd/system/sockets.target.wants/*udev* "$1"/lib/systemd/system/sockets.target.wants/*initctl* "$1"/lib/systemd/system/basic.target.wants/*; echo ReadKMsg=no >> "$1"/etc/systemd/journald.conf; ln -sf /usr/lib/systemd/systemd "$1"/sbin/init' \
    --customize-hook='chroot "$1" systemctl enable kubelet.service containerd.service undo-mount-hacks.service && chroot "$1" systemctl mask systemd-binfmt.service && mkdir -p "$1"/etc/kubernetes/manifests' \
    --customize-hook='rm -f "$1"/usr/lib/sysctl.d/50-pid-max.conf "$1"/usr/lib/sysctl.d/99-protect-links.conf' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    "$DEBIAN_SUITE" "${rootfs%.tar}.tmp.tar" http://deb.debian.org/debian
  mv "${rootfs%.tar}.tmp.tar" "$rootfs"  # the name ends in .tar: mmdebstrap picks its output format by it
fi
# end rootfs
[ $fetch = 1 ] && exit 0
base=encoderpool.local/kind-base:$rootfs_key-$overlay_key
if ! docker image inspect "$base" >/dev/null 2>&1; then
  docker import --change 'ENV container=docker' --change 'ENTRYPOINT ["/usr/local/bin/entrypoint","/sbin/init"]' \
    "$rootfs" "$base-import" >/dev/null
  ctx=$work/ctx-base; rm -rf "$ctx"; mkdir -p "$ctx"; cp -a "$overlay" "$ctx/overlay"
  # docker import cannot set STOPSIGNAL; the overlay is re-applied so that patch edits do not
  # need a new mmdebstrap run.
  printf 'FROM %s\nCOPY overlay/ /\nSTOPSIGNAL SIGRTMIN+3\n' "$base-import" > "$ctx/Dockerfile"
  docker build --network none -q -t "$base" "$ctx" >/dev/null
  docker rmi "$base-import" >/dev/null
fi

cp_bin=$("$root/e2e/cluster/build.sh")   # kube-apiserver, -controller-manager, -scheduler, etcd, kubectl
kind_bin=$("$here/../build.sh")           # kubelet, kubeadm, kube-proxy, crictl, coredns, pause
findbin() { for d in "$kind_bin" "$cp_bin"; do [ -x "$d/$1" ] && { echo "$d/$1"; return; }; done; log "missing binary $1"; exit 1; }

inputs() {  # everything that decides the node image's bytes
  cat "$0" "$here/kind-base-files.patch" "$here/../versions.env" "$root/e2e/cluster/versions.env"
  find "$here/static-root" -type f -print0 | sort -z | xargs -0 cat
  echo "$pkgs"
  for b in kubelet kubeadm kubectl crictl kube-apiserver kube-controller-manager kube-scheduler kube-proxy etcd coredns pause; do
    sha256sum < "$(findbin $b)"; done
}
key=$(inputs | sha256sum | cut -c1-12)
node_image=encoderpool.local/kind-node:v$K8S_VERSION-$key
if docker image inspect "$node_image" >/dev/null 2>&1; then echo "$node_image"; exit 0; fi
# 3. control-plane images, tagged as `kubeadm config images list` names them
ctx=$work/ctx-images; rm -rf "$ctx"; mkdir -p "$ctx"
image() {  # image binary dest [base] [user]
  local img=$1 bin=$2 dest=$3 from=${4:-scratch} user=${5:-} d
  d=$ctx/$(echo "$img" | tr '/:' '__'); mkdir -p "$d"; cp "$(findbin "$bin")" "$d/$bin"
  { echo "FROM $from"
    [ "$from" = scratch ] && { cp -a "$here/static-root" "$d/root"; echo "COPY root/ /"; }
    echo "COPY $bin $dest"
    echo "ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"
    echo "ENTRYPOINT [\"$dest\"]"
    [ -n "$user" ] && echo "USER $user"
    true; } > "$d/Dockerfile"
  docker build --network none -q -t "$img" "$d" >/dev/null
}
V=v$K8S_VERSION
image registry.k8s.io/kube-apiserver:$V          kube-apiserver          /usr/local/bin/kube-apiserver
image registry.k8s.io/kube-controller-manager:$V kube-controller-manager /usr/local/bin/kube-controller-manager
image registry.k8s.io/kube-scheduler:$V          kube-scheduler          /usr/local/bin/kube-scheduler
# kube-proxy needs iptables and conntrack: the node's own Debian root has both.
image registry.k8s.io/kube-proxy:$V              kube-proxy              /usr/local/bin/kube-proxy "$base"
image registry.k8s.io/etcd:$ETCD_IMAGE_TAG       etcd                    /usr/local/bin/etcd
image registry.k8s.io/coredns/coredns:v$COREDNS_VERSION coredns          /coredns
image registry.k8s.io/pause:$PAUSE_VERSION       pause                   /pause scratch 65535:65535
images=(registry.k8s.io/kube-apiserver:$V registry.k8s.io/kube-controller-manager:$V
        registry.k8s.io/kube-scheduler:$V registry.k8s.io/kube-proxy:$V registry.k8s.io/etcd:$ETCD_IMAGE_TAG
        registry.k8s.io/coredns/coredns:v$COREDNS_VERSION registry.k8s.io/pause:$PAUSE_VERSION)

# 4. the node: binaries + images preloaded the way kind's node-image builder does
c=encoderpool-nodebuild-$$
trap 'docker rm -f "$c" >/dev/null 2>&1 || true' EXIT
docker run -d --network none --name "$c" --entrypoint sleep --cap-add=ALL --cap-drop=SYS_RESOURCE \
  --security-opt seccomp=unconfined --security-opt apparmor=unconfined "$base" infinity >/dev/null
for b in kubeadm kubelet kubectl; do docker cp "$(findbin $b)" "$c:/usr/bin/$b"; done
docker cp "$(findbin crictl)" "$c:/usr/local/bin/crictl"
docker exec "$c" sh -c 'chown root:root /usr/bin/kubeadm /usr/bin/kubelet /usr/bin/kubectl /usr/local/bin/crictl && chmod 0755 /usr/bin/kubeadm /usr/bin/kubelet /usr/bin/kubectl /usr/local/bin/crictl'
printf 'v%s' "$K8S_VERSION" | docker exec -i "$c" sh -c 'cat > /kind/version'
docker exec "$c" bash -c 'nohup containerd >/tmp/containerd.log 2>&1 & for i in $(seq 1 30); do [ -S /run/containerd/containerd.sock ] && ctr version >/dev/null 2>&1 && exit 0; sleep 1; done; cat /tmp/containerd.log; exit 1'
docker save "${images[@]}" | docker exec -i "$c" ctr --namespace=k8s.io images import --label=io.cri-containerd.pinned=pinned --all-platforms --no-unpack --digests - >/dev/null
docker exec "$c" bash -c 'kill -TERM $(pidof containerd); for i in $(seq 1 20); do pidof containerd >/dev/null || exit 0; sleep 0.5; done; exit 1'
docker exec "$c" sh -c 'rm -rf /tmp/* /run/containerd'
docker commit --change 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]' \
  --change 'ENV HTTP_PROXY="" HTTPS_PROXY="" NO_PROXY=""' "$c" "$node_image" >/dev/null
log "built $node_image in $(( $(date +%s) - t0 )) s"
docker images --format '{{.Repository}}:{{.Tag}}' encoderpool.local/kind-node | grep -vxF "$node_image" | xargs -r docker rmi >/dev/null 2>&1 || true
echo "$node_image"
