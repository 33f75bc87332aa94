#!/usr/bin/env bash
# No packet from a container may leave this machine. Docker NATs containers to the outside,
# and inside a kind node a packet to a Service IP sent before kube-proxy has programmed it
# follows the node's default route out. So: reject everything forwarded from a docker bridge
# to any other interface (IPv4 and IPv6). Host <-> container traffic (kind's API port on
# 127.0.0.1, port-forwards) is INPUT/OUTPUT, not FORWARD, and is unaffected. Idempotent;
# tools/dockerd.sh runs it before dockerd starts and again once it runs (dockerd re-inserts
# its own FORWARD jumps at start). tests/kind/test_egress_guard.py proves it against a
# network namespace of the test's own, never a real address.
#   tools/egress-guard.sh          install (or re-assert) the rules
#   tools/egress-guard.sh --check  exit 0 only if every rule is in place
set -euo pipefail
bridges=(docker0 br-+)
check=0; [ "${1:-}" = --check ] && check=1

rule4() { iptables -w -C DOCKER-USER -i "$1" ! -o "$1" -j REJECT --reject-with icmp-net-unreachable 2>/dev/null; }
rule6() { ip6tables -w -C FORWARD -i "$1" ! -o "$1" -j REJECT 2>/dev/null; }
jump() { iptables -w -C FORWARD -j DOCKER-USER 2>/dev/null; }

if [ $check = 1 ]; then
  jump || { echo "egress-guard: FORWARD does not jump to DOCKER-USER" >&2; exit 1; }
  for br in "${bridges[@]}"; do
    rule4 "$br" || { echo "egress-guard: IPv4 rule for $br missing" >&2; exit 1; }
    rule6 "$br" || { echo "egress-guard: IPv6 rule for $br missing" >&2; exit 1; }
  done
  exit 0
fi
iptables -w -N DOCKER-USER 2>/dev/null || true
# First in FORWARD, ahead of anything dockerd adds.
if jump; then iptables -w -D FORWARD -j DOCKER-USER; fi
iptables -w -I FORWARD 1 -j DOCKER-USER
for br in "${bridges[@]}"; do
  rule4 "$br" || iptables -w -I DOCKER-USER 1 -i "$br" ! -o "$br" -j REJECT --reject-with icmp-net-unreachable
  rule6 "$br" || ip6tables -w -I FORWARD 1 -i "$br" ! -o "$br" -j REJECT
done
