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
# Env: DOCKER_HOST (tools/dockerd.sh start), ENCODERPOOL_CACHE
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
. "$root/e2e/cluster/versions.env"
. "$here/../versions.env"
: "${DOCKER_HOST:?DOCKER_HOST: the engine tools/dockerd.sh started}"
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
work=$cache/kind; mkdir -p "$work"
docker() { /usr/bin/docker "$@"; }
log() { echo "node/image.sh: $*" >&2; }
pkgs=systemd,systemd-sysv,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,bash,ca-certificates,curl,jq,procps,containerd,runc,containernetworking-plugins,socat,e2fsprogs,iputils-ping
t0=$(date +%s)

# 1. kind's base files + our patch
overlay_key=$( { echo "$KIND_VERSION"; cat "$here/kind-base-files.patch"; } | sha256sum | cut -c1-12)
overlay=$work/overlay-$overlay_key
if [ ! -d "$overlay" ]; then
  src=$(GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/kind@v$KIND_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')
  rm -rf "$overlay.tmp"; mkdir -p "$overlay.tmp"
  cp -a "$src/images/base/files/." "$overlay.tmp/"; chmod -R u+w "$overlay.tmp"
  (cd "$overlay.tmp" && patch -p1 --no-backup-if-mismatch -s < "$here/kind-base-files.patch")
  mv "$overlay.tmp" "$overlay"
fi

# 2. the Debian root filesystem (the expensive part: only when its inputs change)
rootfs_key=$( { echo "$pkgs $DEBIAN_SUITE"; cat "$here/kind-base-files.patch"; sed -n '/^# rootfs:/,/^# end rootfs/p' "$0"; } | sha256sum | cut -c1-12)
rootfs=$work/rootfs-$rootfs_key.tar
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
    "$DEBIAN_SUITE" "$rootfs.tmp" http://deb.debian.org/debian
  mv "$rootfs.tmp" "$rootfs"
fi
# end rootfs
base=encoderpool.local/kind-base:$rootfs_key
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

