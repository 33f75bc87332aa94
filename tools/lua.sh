#!/usr/bin/env bash
# Print the path of a Lua 5.1 interpreter (Argo CD runs health checks on gopher-lua, a
# Lua 5.1), installing Debian's lua5.1 if it is missing.
set -euo pipefail
"$(dirname "$0")/apt.sh" lua5.1
command -v lua5.1
