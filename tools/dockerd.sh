#!/usr/bin/env bash
# The project's own Docker engine: Debian's docker.io, data under $ENCODERPOOL_CACHE/docker,
# its own socket, stopped by PID. The egress guard is in place before it starts.
#   tools/dockerd.sh start    install docker.io if missing, start (or reuse) the engine;
#                             prints the DOCKER_HOST to use on its last line
#   tools/dockerd.sh stop     stop the engine this script started (by its PID file)
#   tools/dockerd.sh host     print the DOCKER_HOST (started or not)
# The host's sysctls are left alone: --ip-forward=false (the host never routes container
# traffic, which the egress guard forbids anyway), and nothing here writes /proc/sys.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) stops the script too
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
state=$cache/docker
run=/run/encoderpool-docker        # exec-root and socket: short paths (unix sockets <108 chars)
sock=$run/docker.sock
host=unix://$sock
log() { echo "dockerd.sh: $*" >&2; }

alive() { [ -f "$run/dockerd.pid" ] && kill -0 "$(cat "$run/dockerd.pid")" 2>/dev/null; }
answering() { DOCKER_HOST=$host /usr/bin/docker version >/dev/null 2>&1; }

install() {
  command -v dockerd >/dev/null && [ -x /usr/bin/docker ] && return 0
  [ "$(id -u)" = 0 ] || { log "dockerd missing and not root: install Debian's docker.io"; exit 1; }
  "$root/tools/apt.sh" docker.io iptables
  # The package's own service must not start an engine of its own.
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    systemctl disable --now docker.socket docker.service >/dev/null 2>&1 || true
  fi
}

start() {
  install
  mkdir -p "$state" "$run"
  exec 8>"$run/start.lock"; flock 8
  if alive && answering; then echo "$host"; return 0; fi
  "$root/tools/egress-guard.sh"
  log "starting dockerd (data root $state)"
  # setsid: its own process group, so a test's cleanup never signals it by accident.
  setsid /usr/sbin/dockerd --data-root "$state" --exec-root "$run/exec" --host "$host" \
    --pidfile "$run/dockerd.pid" --ip-forward=false --storage-driver overlay2 \
    >"$run/dockerd.log" 2>&1 < /dev/null &
  for _ in $(seq 1 120); do
    answering && break
    kill -0 $! 2>/dev/null || { log "dockerd exited:"; tail -n 30 "$run/dockerd.log" >&2; exit 1; }
    sleep 0.5
  done
  answering || { log "dockerd did not answer in 60 s:"; tail -n 30 "$run/dockerd.log" >&2; exit 1; }
  "$root/tools/egress-guard.sh"          # dockerd re-inserts its FORWARD jumps at start
  "$root/tools/egress-guard.sh" --check
  echo "$host"
}

stop() {
  alive || { log "not running"; return 0; }
  local pid; pid=$(cat "$run/dockerd.pid")
  kill -TERM "$pid"
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || { log "stopped (pid $pid)"; return 0; }; sleep 0.5; done
  log "dockerd $pid did not stop in 30 s; killing it"; kill -KILL "$pid"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  host) echo "$host" ;;
  *) echo "usage: $0 start|stop|host" >&2; exit 2 ;;
esac
