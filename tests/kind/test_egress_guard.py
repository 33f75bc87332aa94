"""No packet from a container leaves the machine (tools/egress-guard.sh, tools/dockerd.sh).

The "outside" is a network namespace this test makes, with an address from the
benchmarking range (198.18.0.0/15) and a listener of its own: never a real
address. The host reaches the listener; a container does not, first as the engine
runs (the host does not forward), then with host forwarding switched on for the
test (restored after), where the guard's REJECT alone stops it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.kind.cluster import ROOT, Engine, Images, run
from tests.waiting import wait_until

pytestmark = pytest.mark.kind

HOST_IP, OUTSIDE_IP, PORT = "198.18.77.1", "198.18.77.2", 8099
FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
PROBE = (
    "import socket, sys\n"
    "try:\n"
    f"    socket.create_connection(('{OUTSIDE_IP}', {PORT}), 5)\n"
    "    print('connected')\n"
    "except OSError as e:\n"
    "    print('errno', e.errno)\n"
)


@pytest.fixture
def outside() -> Iterator[str]:
    """A namespace "outside" the machine, with an HTTP listener at OUTSIDE_IP:PORT."""
    tag = f"{os.getpid() % 100000}"
    ns, host_if, ns_if = f"epout{tag}", f"epo{tag}h", f"epo{tag}n"
    ip = ["ip"]
    run([*ip, "netns", "add", ns])
    listener = None
    try:
        run([*ip, "link", "add", host_if, "type", "veth", "peer", "name", ns_if])
        run([*ip, "link", "set", ns_if, "netns", ns])
        run([*ip, "addr", "add", f"{HOST_IP}/30", "dev", host_if])
        run([*ip, "link", "set", host_if, "up"])
        inns = [*ip, "netns", "exec", ns]
        run([*inns, "ip", "addr", "add", f"{OUTSIDE_IP}/30", "dev", ns_if])
        run([*inns, "ip", "link", "set", ns_if, "up"])
        run([*inns, "ip", "link", "set", "lo", "up"])
        run([*inns, "ip", "route", "add", "default", "via", HOST_IP])
        listener = subprocess.Popen(
            [*inns, "python3", "-m", "http.server", str(PORT), "--bind", OUTSIDE_IP],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        yield ns
    finally:
        if listener is not None:
            os.killpg(listener.pid, 15)
            listener.wait(10)
        run([*ip, "link", "del", host_if], check=False)
        run([*ip, "netns", "del", ns], check=False)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def rejected_packets() -> int:
    out = run(["iptables", "-w", "-L", "DOCKER-USER", "-v", "-x", "-n"]).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if "REJECT" in line)


def probe(engine: Engine, image: str) -> str:
    env = {**os.environ, "DOCKER_HOST": engine.host}
    out = run(["docker", "run", "--rm", "--entrypoint", "python3", image, "-c", PROBE], env=env)
    return out.stdout.strip()


@contextlib.contextmanager
def host_forwarding() -> Iterator[None]:
    before = FORWARD.read_text()
    FORWARD.write_text("1\n")
    try:
        yield
    finally:
        FORWARD.write_text(before)


def test_the_guard_is_in_place(engine: Engine) -> None:
    run([ROOT / "tools" / "egress-guard.sh", "--check"])


def test_no_container_reaches_outside(engine: Engine, built_images: Images, outside: str) -> None:
    # The address is live: the host itself gets an answer (once the listener is up).
    wait_until(
        "the outside listener answers the host", lambda: answers(f"http://{OUTSIDE_IP}:{PORT}/")
    )
    assert probe(engine, built_images.base) != "connected"
    before = rejected_packets()
    with host_forwarding():
        answer = probe(engine, built_images.base)
    assert answer == "errno 101", answer  # ENETUNREACH: the guard's icmp-net-unreachable
    assert rejected_packets() > before
