"""Real NIXL READs between two processes over UCX (tcp, self, sm), through our side channel.

The producer runs in a child process (this module's ``__main__``): a shared region,
its NIXL agent and side channel, one item written into a slot. The test process is the
consumer: a ``Puller`` fetches the producer's metadata, READs, verifies; the producer
receives the release notice. Then the failure cases: bad checksum, offset outside the
region, wrong agent, unreachable producer, producer killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.vllm_server import REPO, base_env
from encoderpool_connector.rdma.buffer import HEADER_BYTES, SharedRegion
from encoderpool_connector.rdma.channel import Coordinates
from encoderpool_connector.rdma.transfer import Puller, PullResult
from encoderpool_contracts.integrity import ChannelKey, checksum

FP = "0123456789abcdef"
ITEM = (1300, 3584)  # tokens x width, bf16: ~9.3 MB, a large real encoder output
UCX_ENV = {"UCX_TLS": "tcp,self,sm"}
KEY = ChannelKey(b"test-nixl-channel-key-0123456789")


def producer_main(shm_dir: str) -> None:
    """Child process: serve one item until stdin closes; print releases as they arrive."""
    from encoderpool_connector.rdma.channel import SideChannelServer
    from encoderpool_connector.rdma.transfer import ProducerAgent

    region = SharedRegion.create(shm_dir, 32 << 20)
    agent = ProducerAgent(region, ("UCX",), key=KEY)
    server = SideChannelServer("127.0.0.1", 0, agent.side_channel_reply(FP), timeout=2.0, key=KEY)
    size = ITEM[0] * ITEM[1] * 2
    offset = 4096 + HEADER_BYTES
    payload = region.view[offset : offset + size]
    payload[:] = (bytes(range(256)) * (size // 256 + 1))[:size]
    print(
        json.dumps(
            {
                "agent": agent.name,
                "port": server.port,
                "offset": offset,
                "size": size,
                "checksum": checksum(payload),
                "length": region.size,
            }
        ),
        flush=True,
    )
    os.set_blocking(sys.stdin.fileno(), False)
    while True:
        for slot, gen in agent.releases():
            print(json.dumps({"release": [slot, gen]}), flush=True)
        try:
            if sys.stdin.read() == "":  # EOF
                break
        except (BlockingIOError, TypeError):
            pass
        time.sleep(0.01)
    server.close()
    agent.close()
    region.close()


class Producer:
    def __init__(self, shm_dir: str) -> None:
        env = {**base_env(), **UCX_ENV}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.connector.rdma.test_nixl", shm_dir],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = "x"
        while line and not line.startswith("{"):  # NIXL logs to stdout too
            line = self.proc.stdout.readline()
        assert line, "producer did not start"
        self.info: dict[str, Any] = json.loads(line)

    def coords(self, **over: Any) -> Coordinates:
        c: dict[str, Any] = {
            "agent": self.info["agent"],
            "host": "127.0.0.1",
            "port": self.info["port"],
            "offset": self.info["offset"],
            "size": self.info["size"],
            "dtype": "bfloat16",
            "shape": ITEM,
            "checksum": self.info["checksum"],
            "gen": 1,
        }
        c.update(over)
        return Coordinates(**c)

    def next_release(self, timeout: float = 10.0) -> list[int]:
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith('{"release"'):
                return list(json.loads(line)["release"])
            if line:
                continue
            time.sleep(0.02)
        raise AssertionError("no release notice")

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ep-rdma-test-") as d:
        yield d


@pytest.fixture(scope="module")
def puller(shm_dir: str) -> Iterator[Puller]:
    os.environ.update(UCX_ENV)  # before this process's first UCX context
    region = SharedRegion.create(shm_dir, 64 << 20)
    p = Puller(region, ("UCX",), fingerprint=FP, metadata_timeout=1.0, key=KEY)
    yield p
    p.close()
    region.close()


@pytest.fixture(scope="module")
def producer(shm_dir: str) -> Iterator[Producer]:
    p = Producer(shm_dir)
    yield p
    p.stop()
    assert p.proc.returncode == 0, "the producer did not exit cleanly (UCX abort at exit?)"


def pull(puller: Puller, coords: Coordinates, local: int = 0, timeout: float = 10.0) -> PullResult:
    return puller.submit(coords, local, timeout).result(timeout + 5)


def test_read_moves_and_verifies_the_item_and_the_producer_hears_of_it(
    puller: Puller, producer: Producer
) -> None:
    c = producer.coords()
    t0 = time.monotonic()
    result = pull(puller, c)
    assert result.ok, result
    got = bytes(puller.region.view[0 : c.size])
    assert checksum(got) == c.checksum
    assert producer.next_release() == [c.offset, c.gen]
    # A second item from the same producer reuses the cached metadata.
    again = pull(puller, c, local=16 << 20)
    assert again.ok, again
    assert producer.next_release() == [c.offset, c.gen]
    print(f"two 9.3 MB READs in {time.monotonic() - t0:.3f} s")


@pytest.mark.parametrize(
    ("over", "kind"),
    [
        ({"checksum": "blake3:" + "00" * 32}, "corrupt"),
        ({"offset": (32 << 20) - 100}, "bad_peer"),
        ({"offset": 1 << 45}, "bad_peer"),
        ({"agent": "ep-p-1-someoneelse"}, "bad_peer"),
    ],
)
def test_bad_coordinates_fail_cleanly(
    puller: Puller, producer: Producer, over: dict[str, Any], kind: str
) -> None:
    result = pull(puller, producer.coords(**over))
    assert not result.ok
    assert result.kind == kind, result
    assert result.slot_free
    assert pull(puller, producer.coords()).ok  # and the channel still works


def test_a_producer_without_the_pool_s_key_is_never_handed_to_nixl(
    puller: Puller, shm_dir: str
) -> None:
    """A real agent's metadata behind a side channel that does not hold the pool's key
    (unsigned, or another pool's): refused before ``add_remote_agent``, so no NIXL connect
    and no READ; the honest producer is still served."""
    from encoderpool_connector.rdma.channel import SideChannelServer
    from encoderpool_connector.rdma.transfer import ProducerAgent

    region = SharedRegion.create(shm_dir, 1 << 20)
    agent = ProducerAgent(region, ("UCX",), key=None)
    servers = [
        SideChannelServer("127.0.0.1", 0, agent.side_channel_reply(FP), timeout=2.0, key=k)
        for k in (None, ChannelKey(b"another-pool-s-key-0123456789ab"))
    ]
    try:
        for server in servers:
            c = Coordinates(
                agent.name, "127.0.0.1", server.port, 0, 4, "bfloat16", (2,),
                "blake3:" + "0" * 64, 1,
            )  # fmt: skip
            result = pull(puller, c)
            assert not result.ok
            assert result.kind in ("unauthenticated", "unreachable"), result
            assert "unsigned" in result.reason or "refused" in result.reason, result
            assert ("127.0.0.1", server.port) not in puller._peers  # never handed to NIXL
    finally:
        for server in servers:
            server.close()
        agent.close()
        region.close()


def test_unreachable_producer_is_a_fast_failure(puller: Puller) -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    c = Coordinates("ep-p-1-x", "127.0.0.1", port, 0, 4, "bfloat16", (2,), "blake3:" + "0" * 64, 1)
    t0 = time.monotonic()
    result = pull(puller, c, timeout=5.0)
    assert not result.ok
    assert result.kind == "unreachable"
    assert time.monotonic() - t0 < 2.0
    # Remembered briefly: the next item from that address fails at once.
    assert pull(puller, c).kind == "unreachable"


def test_killed_producer_fails_within_the_timeout(puller: Puller, shm_dir: str) -> None:
    p = Producer(shm_dir)
    try:
        assert pull(puller, p.coords()).ok
        p.proc.kill()
        p.proc.wait(10)
        t0 = time.monotonic()
        result = pull(puller, p.coords(), timeout=3.0)
        assert not result.ok, result
        assert time.monotonic() - t0 < 6.0
    finally:
        p.stop()
    leftovers = [n for n in os.listdir(shm_dir) if str(p.proc.pid) in n]
    assert leftovers  # the killed producer could not unlink its region ...
    SharedRegion.create(shm_dir, 1 << 20).close()  # ... the next one sweeps it
    assert not [n for n in os.listdir(shm_dir) if str(p.proc.pid) in n]


if __name__ == "__main__":
    producer_main(sys.argv[1] if len(sys.argv) > 1 else str(Path("/dev/shm")))
