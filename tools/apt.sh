#!/usr/bin/env bash
# Make sure Debian packages are installed: `tools/apt.sh mmdebstrap lua5.1`. Installs only
# what is missing (dpkg says so), with apt-get (root, Debian's archive), refreshing the
# package lists once if the first try fails. A fresh machine has none of these; every
# script that needs one calls this first, so nothing depends on a shell's history.
set -euo pipefail
missing=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} = 0 ] && exit 0
[ "$(id -u)" = 0 ] || { echo "apt.sh: missing ${missing[*]}; install them (as root)" >&2; exit 1; }
echo "apt.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 \
  || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; }
