"""The RDMA connector's scheduler and worker sides without an engine, on real NIXL (UCX
tcp/self/sm): a producer and a consumer in this process, driven the way vLLM's scheduler
and model runner call them, with stand-in requests.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from e2e.vllm_server import free_port
from encoderpool_connector.rdma.channel import parse_coordinates, sign_coordinates
from encoderpool_connector.rdma.metadata import RdmaMetadata, RdmaWorkerMetadata
from encoderpool_connector.rdma.scheduler import RdmaScheduler
from encoderpool_connector.rdma.worker import RdmaWorker
from encoderpool_contracts import ConnectorConfig
from encoderpool_contracts.integrity import ChannelKey
from tests.waiting import wait_until

FP = "0123456789abcdef"
KEY = ChannelKey(b"test-scheduler-channel-key-0123")
TOKENS, WIDTH = 16, 128
os.environ.setdefault("UCX_TLS", "tcp,self,sm")


class _Resolver:
    def fields_for(self, modality: str) -> set[str]:
        return set()


@dataclass
class Req:
    """What the connector reads of vLLM's Request."""

    request_id: str
    hashes: list[str]
    ec_transfer_params: dict[str, Any] | None = None
    tokens: int = TOKENS
    mm_features: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.mm_features = [
            SimpleNamespace(
                identifier=h,
                modality="image",
                data=None,
                mm_position=SimpleNamespace(offset=i * 100, length=self.tokens),
            )
            for i, h in enumerate(self.hashes)
        ]

    def get_num_encoder_embeds(self, index: int) -> int:
        return self.tokens


def config(**rdma: Any) -> ConnectorConfig:
    settings: dict[str, Any] = {
        "side_channel_port": free_port(),
        "bind_host": "127.0.0.1",
        "buffer_bytes": 1 << 20,
        "transfer_timeout_ms": 3000,
        "metadata_timeout_ms": 1000,
        **rdma,
    }
    return ConnectorConfig(
        transport="rdma",
        model_fingerprint=FP,
        encoder_output_widths={"image": WIDTH},
        rdma=settings,
    )


class Side:
    """One role's scheduler + worker."""

    def __init__(
        self, cfg: ConnectorConfig, shm_dir: str, *, producer: bool, key: ChannelKey | None = KEY
    ) -> None:
        assert cfg.rdma is not None
        cfg = cfg.model_copy(update={"rdma": cfg.rdma.model_copy(update={"shm_dir": shm_dir})})
        self.sched = RdmaScheduler(
            cfg,
            is_producer=producer,
            is_consumer=not producer,
            model_dtype="bfloat16",
            widths={"image": WIDTH},
            metadata_resolver=_Resolver(),
            advertise_host="127.0.0.1",
            channel_key=key,
        )
        self.worker = RdmaWorker(cfg, is_producer=producer, is_consumer=not producer)
        self.worker._device = torch.device("cpu")

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def signed(coords: dict[str, Any], mm_hash: str, key: ChannelKey = KEY, **kw: Any) -> Any:
    """Coordinates as a producer holding ``key`` would announce them."""
    now = kw.pop("now", time.time())
    return sign_coordinates(key, parse_coordinates(coords), mm_hash, FP, now)


def embedding(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((TOKENS, WIDTH), generator=g).to(torch.bfloat16)


def produce(p: Side, req: Req, cache: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One producer step for ``req`` (encoding what the cache lacks), then its params."""
    assert p.sched.ensure_cache_available(req, 0)
    meta = p.sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={req.request_id: 1}))
    p.worker.start_save_caches(cache, meta)
    for i, h in enumerate(req.hashes):
        if h not in cache:  # the encoder runs, then vLLM calls save_caches
            cache[h] = embedding(int(h.split("-")[-1]) if "-" in h else i)
            p.worker.save_caches(cache, h)
    params = p.sched.request_finished(req)
    assert params is not None
    return params


def wait_ready(c: Side, req: Req, timeout: float = 10.0) -> None:
    wait_until(
        "the pull to be decided", lambda: c.sched.ensure_cache_available(req, 0), timeout, 0.005
    )


def consume(c: Side, req: Req) -> dict[str, torch.Tensor]:
    """Scheduler decides, allocates, worker loads, outputs flow back; returns what loaded."""
    wait_ready(c, req)
    for i, h in enumerate(req.hashes):
        if c.sched.has_cache_item(h):
            c.sched.update_state_after_alloc(req, i)
    meta = c.sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    cache: dict[str, torch.Tensor] = {}
    c.worker.start_load_caches(cache, meta)
    c.sched.update_connector_output(c.worker.build_connector_worker_meta())
    c.sched.request_finished(req)
    return cache


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ep-rdma-sched-") as d:
        yield d


@pytest.fixture
def pair(shm_dir: str) -> Iterator[tuple[Side, Side]]:
    p = Side(config(), shm_dir, producer=True)
    c = Side(config(), shm_dir, producer=False)
    yield p, c
    c.close()
    p.close()


def slots_after_a_step(side: Side) -> int:
    """Run the scheduler's per-step housekeeping; how many slots are still held."""
    side.sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    return len(side.sched.alloc)


def wait_for(pred: Any, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_full_flow_and_slots_are_given_back(pair: tuple[Side, Side]) -> None:
    p, c = pair
    pcache: dict[str, torch.Tensor] = {}
    params = produce(p, Req("r1", ["h-1", "h-2"]), pcache)
    assert set(params) == {"h-1", "h-2"}
    for h in ("h-1", "h-2"):
        rd = params[h]["encoderpool"]["rdma"]
        assert rd["shape"] == [TOKENS, WIDTH]
        assert p.sched.channel is not None
        assert rd["port"] == p.sched.channel.port
    assert not c.sched.has_cache_item("h-1")  # nothing is a hit before it is local
    got = consume(c, Req("c1", ["h-1", "h-2"], params))
    assert torch.equal(got["h-1"], pcache["h-1"])
    assert torch.equal(got["h-2"], pcache["h-2"])
    assert len(c.sched.alloc) == 0  # loaded: the consumer's slots are free again
    stats = c.sched.stats.take()
    assert stats is not None
    assert stats.data["hits"] == 2
    assert stats.data["loads"] == 2
    # The READs' notifications free the producer's slots on its next step.
    wait_for(
        lambda: slots_after_a_step(p) == 0,
        "producer slots never released",
    )
    pstats = p.sched.stats.take()
    assert pstats is not None
    assert pstats.data["released"] == 2


def test_item_already_in_the_encoder_cache_is_offered_again(pair: tuple[Side, Side]) -> None:
    """After its slot was released, a repeat of the item (not re-encoded: vLLM's encoder
    cache has it, so save_caches never fires) is copied in start_save_caches."""
    p, c = pair
    pcache: dict[str, torch.Tensor] = {}
    first = produce(p, Req("r1", ["h-5"]), pcache)
    consume(c, Req("c1", ["h-5"], first))
    wait_for(
        lambda: slots_after_a_step(p) == 0,
        "slot never released",
    )
    again = produce(p, Req("r2", ["h-5"]), pcache)
    assert "rdma" in again["h-5"]["encoderpool"]
    got = consume(c, Req("c2", ["h-5"], again))
    assert torch.equal(got["h-5"], pcache["h-5"])


def test_producer_evicts_oldest_when_full_and_consumer_rejects_the_stale(
    shm_dir: str,
) -> None:
    item = TOKENS * WIDTH * 2 + 256
    p = Side(config(buffer_bytes=1 << 20), shm_dir, producer=True)
    c = Side(config(), shm_dir, producer=False)
    try:
        pcache: dict[str, torch.Tensor] = {}
        n = (1 << 20) // item + 3
        params = [produce(p, Req(f"r{i}", [f"e-{i}"]), pcache) for i in range(n)]
        pstats = p.sched.stats.take()
        assert pstats is not None
        assert pstats.data["evicted"] >= 3
        assert pstats.data["announced"] == n
        # The first item's slot now holds another item: the checksum catches it -> miss.
        req = Req("c0", ["e-0"], params[0])
        wait_ready(c, req)
        assert not c.sched.has_cache_item("e-0")
        c.sched.request_finished(req)
        # The newest is intact.
        got = consume(c, Req("cn", [f"e-{n - 1}"], params[-1]))
        assert torch.equal(got[f"e-{n - 1}"], pcache[f"e-{n - 1}"])
        cstats = c.sched.stats.take()
        assert cstats is not None
        assert cstats.data["corrupt"] == 1
    finally:
        c.close()
        p.close()


def test_consumer_without_room_encodes_itself(shm_dir: str) -> None:
    p = Side(config(), shm_dir, producer=True)
    c = Side(config(buffer_bytes=1 << 20), shm_dir, producer=False)
    try:
        huge = Req("r", ["big-1"], tokens=5000)  # 5000 x 128 bf16 = 1.28 MB > 1 MiB
        params = produce(p, huge, {})
        assert "rdma" not in params["big-1"]["encoderpool"]  # producer had no room either
        forged = {
            "big-1": {
                "encoderpool": {
                    "v": 1,
                    "fingerprint": FP,
                    "rdma": {
                        "v": 1,
                        "agent": "ep-p-1-x",
                        "host": "127.0.0.1",
                        "port": 5600,
                        "offset": 0,
                        "size": 5000 * WIDTH * 2,
                        "dtype": "bfloat16",
                        "shape": [5000, WIDTH],
                        "checksum": "blake3:" + "0" * 64,
                        "gen": 1,
                    },
                }
            }
        }
        announcement: dict[str, Any] = forged["big-1"]["encoderpool"]
        announcement["rdma"] = signed(announcement["rdma"], "big-1")  # a key holder's
        req = Req("c", ["big-1"], forged, tokens=5000)
        assert c.sched.ensure_cache_available(req, 0)  # decided at once: a miss
        assert not c.sched.has_cache_item("big-1")
        stats = c.sched.stats.take()
        assert stats is not None
        assert stats.data["no_room"] == 1
    finally:
        c.close()
        p.close()


def test_silent_producer_times_out_and_the_request_goes_on(shm_dir: str) -> None:
    """A side channel that accepts but never answers: the pull times out, a miss."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    c = Side(config(transfer_timeout_ms=300, metadata_timeout_ms=5000), shm_dir, producer=False)
    try:
        coords = {
            "v": 1,
            "agent": "ep-p-1-x",
            "host": "127.0.0.1",
            "port": silent.getsockname()[1],
            "offset": 0,
            "size": TOKENS * WIDTH * 2,
            "dtype": "bfloat16",
            "shape": [TOKENS, WIDTH],
            "checksum": "blake3:" + "0" * 64,
            "gen": 1,
        }
        rdma = signed(coords, "s-1")
        params = {"s-1": {"encoderpool": {"v": 1, "fingerprint": FP, "rdma": rdma}}}
        req = Req("c", ["s-1"], params)
        t0 = time.monotonic()
        assert not c.sched.ensure_cache_available(req, 0)  # in flight: deferred
        wait_ready(c, req, timeout=3.0)
        assert time.monotonic() - t0 < 2.0
        assert not c.sched.has_cache_item("s-1")
        stats = c.sched.stats.take()
        assert stats is not None
        assert stats.data["transfer_timeouts"] == 1
        c.sched.request_finished(req)
        assert len(c.sched.alloc) == 0
    finally:
        c.close()
        silent.close()


def test_request_finished_mid_pull_frees_the_slot_later(pair: tuple[Side, Side]) -> None:
    p, c = pair
    params = produce(p, Req("r", ["m-1"]), {})
    req = Req("c", ["m-1"], params)
    c.sched.ensure_cache_available(req, 0)
    c.sched.request_finished(req)  # aborted while the READ may be in flight
    wait_for(
        lambda: slots_after_a_step(c) == 0,
        "consumer slot never freed",
    )
    assert not c.sched.has_cache_item("m-1")


def test_a_failed_load_is_encoded_in_the_same_step(pair: tuple[Side, Side]) -> None:
    p, c = pair
    params = produce(p, Req("r", ["f-1"]), {})
    req = Req("c", ["f-1"], params)
    wait_ready(c, req)
    c.sched.update_state_after_alloc(req, 0)
    inputs: dict[str, list[int]] = {"other": [1]}
    meta = c.sched.build_connector_meta(
        SimpleNamespace(num_scheduled_tokens={}, scheduled_encoder_inputs=inputs)
    )
    assert isinstance(meta, RdmaMetadata)
    meta.region = "/dev/shm/encoderpool-rdma-1-00000000"  # the worker cannot map this
    c.worker.region = None
    cache: dict[str, torch.Tensor] = {}
    c.worker.start_load_caches(cache, meta)
    assert "f-1" not in cache  # never zeros: the model runner encodes it in this step
    assert inputs == {"other": [1], "c": [0]}
    wm = c.worker.build_connector_worker_meta()
    assert isinstance(wm, RdmaWorkerMetadata)
    assert wm.failed == {"f-1"}
    c.sched.update_connector_output(wm)
    assert c.sched.take_unavailable_requests() == set()  # the request goes on
    assert len(c.sched.alloc) == 0
    stats = c.sched.stats.take()
    assert stats is not None
    assert stats.data["load_failures"] == 1


OTHER_KEY = ChannelKey(b"another-pool-s-key-0123456789ab")


def test_unsigned_forged_moved_or_stale_coordinates_are_never_connected_to(
    shm_dir: str,
) -> None:
    """Coordinates naming a listener that is no producer of the pool: unsigned, signed with
    another key, signed for another item, changed after signing, or too old. Each is a miss
    counted as unauthenticated, and the listener never sees a connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    c = Side(config(slot_ttl_s=60), shm_dir, producer=False)
    coords = {
        "v": 1,
        "agent": "ep-p-1-x",
        "host": "127.0.0.1",
        "port": listener.getsockname()[1],
        "offset": 0,
        "size": TOKENS * WIDTH * 2,
        "dtype": "bfloat16",
        "shape": [TOKENS, WIDTH],
        "checksum": "blake3:" + "0" * 64,
        "gen": 1,
    }
    cases = {
        "unsigned": coords,
        "another_key": signed(coords, "h-2", key=OTHER_KEY),
        "another_item": signed(coords, "h-1"),
        "changed": {**signed(coords, "h-4"), "offset": 64},
        "stale": signed(coords, "h-5", now=time.time() - 61),
    }
    try:
        for i, (case, rdma) in enumerate(cases.items(), start=1):
            h = f"h-{i + 1}" if case == "another_item" else f"h-{i}"
            params = {h: {"encoderpool": {"v": 1, "fingerprint": FP, "rdma": rdma}}}
            req = Req(f"c{i}", [h], params)
            assert c.sched.ensure_cache_available(req, 0), case  # decided at once: a miss
            assert not c.sched.has_cache_item(h), case
            c.sched.request_finished(req)
        stats = c.sched.stats.take()
        assert stats is not None
        assert stats.data["unauthenticated"] == len(cases)
        assert stats.data["misses"] == len(cases)
        time.sleep(0.2)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody ever connected
    finally:
        c.close()
        listener.close()


def test_sides_with_different_keys_never_hit(shm_dir: str) -> None:
    """A producer of another pool (another key): its items are encoded by the consumer."""
    p = Side(config(), shm_dir, producer=True, key=OTHER_KEY)
    c = Side(config(), shm_dir, producer=False)
    try:
        params = produce(p, Req("r", ["k-1"]), {})
        assert "rdma" in params["k-1"]["encoderpool"]
        req = Req("c", ["k-1"], params)
        assert c.sched.ensure_cache_available(req, 0)
        assert not c.sched.has_cache_item("k-1")
        stats = c.sched.stats.take()
        assert stats is not None
        assert stats.data["unauthenticated"] == 1
    finally:
        c.close()
        p.close()
