#!/usr/bin/env bash
# Print the path of a Lua 5.1 interpreter (Argo CD runs health checks on gopher-lua, a
# Lua 5.1), installing Debian's lua5.1 if it is missing. Needs root and Debian's archive
# the first time.
set -euo pipefail
if ! command -v lua5.1 >/dev/null; then
  echo "lua.sh: installing Debian's lua5.1" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends lua5.1 >&2 \
    || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends lua5.1 >&2; }
fi
command -v lua5.1
