"""The rdma producer's saves off the encoder step (``rdma.writer`` on ``core.savequeue``).

The step only marks the slot WRITING and queues the output: a host output by reference
(no copy on the step), a device output through the bounded staging pool (here a host
tensor sent down that path, and a stand-in event for the device copy). The writer
thread copies, hashes and writes the READY header last, so a slot is announceable only
whole and hashed; the scheduler's ``request_finished`` waits for it, boundedly, and
keeps a slot whose write outlived the wait until that write ended. A full queue or pool
drops the save, counts it and clears the mark, never blocking the step. Writers are
held on purpose (``Gate``); nothing here asserts a wall-clock bound tighter than seconds.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import blake3
import pytest
import torch

from e2e.vllm_server import free_port
from encoderpool_connector.rdma import buffer as buffer_module
from encoderpool_connector.rdma import scheduler_producer
from encoderpool_connector.rdma import worker as worker_module
from encoderpool_connector.rdma import writer as writer_module
from encoderpool_connector.rdma.buffer import (
    HEADER_BYTES,
    MARK_BYTES,
    STATE_READY,
    STATE_WRITING,
    SharedRegion,
    SlotHeader,
    align,
    slot_state,
    unpack_slot_header,
)
from encoderpool_connector.rdma.metadata import RdmaMetadata, WritePlan
from encoderpool_connector.rdma.scheduler import RdmaScheduler
from encoderpool_connector.rdma.worker import RdmaWorker
from encoderpool_connector.rdma.writer import RdmaWriter
from encoderpool_contracts import ConnectorConfig
from tests.connector.fixtures import CopiesInFlight

FP = "0123456789abcdef"
TOKENS, WIDTH = 16, 128
ITEM_BYTES = TOKENS * WIDTH * 2  # bfloat16: 4 KiB
SLOT = align(HEADER_BYTES + ITEM_BYTES)
KiB = 1 << 10
os.environ.setdefault("UCX_TLS", "tcp,self,sm")


class Gate:
    """Holds the writer thread at ``where`` (inside its write, the region lock held) until
    ``open``; records what each write was handed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, where: str = "copy") -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.handed: list[tuple[str, int]] = []  # (mm_hash, data_ptr of the tensor)
        if where == "copy":
            real_copy = RdmaWriter._copy_and_header

            def gated_copy(region: SharedRegion, plan: WritePlan, tensor: torch.Tensor) -> int:
                self._hold()
                self.handed.append((plan.mm_hash, tensor.data_ptr()))
                return real_copy(region, plan, tensor)

            monkeypatch.setattr(RdmaWriter, "_copy_and_header", staticmethod(gated_copy))
        else:  # after the payload is copied and hashed, before the header is written
            real_header = buffer_module.write_header  # what the writer module imported

            def gated_header(view: memoryview, offset: int, header: bytes) -> None:
                self._hold()
                real_header(view, offset, header)

            monkeypatch.setattr(writer_module, "write_header", gated_header)

    def _hold(self) -> None:
        self.entered.set()
        assert self.opened.wait(30)


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ep-rdma-saves-") as d:
        yield d


@pytest.fixture
def region(shm_dir: str) -> Iterator[SharedRegion]:
    """The scheduler's region (mapped here as the scheduler maps it)."""
    r = SharedRegion.create(shm_dir, 1 << 20)
    yield r
    r.close()


def rdma_config(shm_dir: str, **rdma: Any) -> ConnectorConfig:
    settings: dict[str, Any] = {
        "shm_dir": shm_dir,
        "side_channel_port": free_port(),
        "bind_host": "127.0.0.1",
        "buffer_bytes": 1 << 20,
        **rdma,
    }
    return ConnectorConfig(
        transport="rdma",
        model_fingerprint=FP,
        encoder_output_widths={"image": WIDTH},
        rdma=settings,
    )


@pytest.fixture
def producer(shm_dir: str) -> Iterator[RdmaWorker]:
    w = RdmaWorker(rdma_config(shm_dir), is_producer=True, is_consumer=False)
    w._device = torch.device("cpu")
    yield w
    w.shutdown()


def item(seed: int, shape: tuple[int, int] = (TOKENS, WIDTH)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


def plans(n: int, first_generation: int = 1, prefix: str = "h") -> list[WritePlan]:
    return [
        WritePlan(f"{prefix}{i}", i * SLOT, SLOT - HEADER_BYTES, first_generation + i)
        for i in range(n)
    ]


def step(
    w: RdmaWorker, region: SharedRegion, writes: list[WritePlan], cache: dict[str, torch.Tensor]
) -> None:
    """One producer step as vLLM drives it: the plans, then ``save_caches`` per output."""
    w.start_save_caches(
        {}, RdmaMetadata(region=region.path, region_bytes=region.size, writes=writes)
    )
    for plan in writes:
        w.save_caches(cache, plan.mm_hash)


def state(region: SharedRegion, plan: WritePlan) -> tuple[int, int] | None:
    return slot_state(region.view[plan.offset : plan.offset + MARK_BYTES])


def header(region: SharedRegion, plan: WritePlan) -> SlotHeader | None:
    h = unpack_slot_header(region.view[plan.offset : plan.offset + HEADER_BYTES])
    return h if h is not None and h.generation == plan.generation else None


def payload(region: SharedRegion, plan: WritePlan, nbytes: int = ITEM_BYTES) -> bytes:
    start = plan.offset + HEADER_BYTES
    return bytes(region.view[start : start + nbytes])


def counters(w: RdmaWorker) -> dict[str, Any]:
    return {k: v for k, v in w.stats.totals.data.items() if not k.endswith("_seconds")}


def assert_whole(region: SharedRegion, plan: WritePlan, out: torch.Tensor) -> None:
    """READY over exactly ``out``'s bytes, with their BLAKE3: what a consumer verifies."""
    h = header(region, plan)
    assert h is not None
    assert payload(region, plan) == raw(out)
    assert h.checksum == blake3.blake3(raw(out)).digest()
    assert h.shape == tuple(out.shape)
    assert h.dtype == "bfloat16"


# ---- the step only queues ----


def test_the_step_returns_while_the_writer_is_held_and_the_slot_shows_writing(
    producer: RdmaWorker, region: SharedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    writes = plans(3)
    cache = {p.mm_hash: item(i) for i, p in enumerate(writes)}
    step(producer, region, writes, cache)  # returns: the writer is held inside the first
    assert gate.entered.wait(10)
    for plan in writes:
        assert state(region, plan) == (STATE_WRITING, plan.generation)
        assert header(region, plan) is None
    assert counters(producer) == {"saves_queued": 3}
    gate.opened.set()
    producer.flush()
    for plan in writes:
        assert state(region, plan) == (STATE_READY, plan.generation)
        assert_whole(region, plan, cache[plan.mm_hash])
    assert counters(producer) == {"saves_queued": 3, "saves": 3, "save_bytes": 3 * ITEM_BYTES}


def test_a_copied_but_unhashed_payload_is_never_a_ready_slot(
    producer: RdmaWorker, region: SharedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The payload lands before the header; until the header is written the slot is still
    WRITING, so the scheduler cannot take it for a whole one."""
    gate = Gate(monkeypatch, where="header")
    (plan,) = plans(1)
    out = item(1)
    step(producer, region, [plan], {plan.mm_hash: out})
    assert gate.entered.wait(10)  # copied and hashed, the header not yet written
    assert payload(region, plan) == raw(out)
    assert state(region, plan) == (STATE_WRITING, plan.generation)
    assert unpack_slot_header(region.view[plan.offset : plan.offset + HEADER_BYTES]) is None
    gate.opened.set()
    producer.flush()
    assert_whole(region, plan, out)


def test_a_host_output_is_handed_over_without_a_copy_on_the_step(
    producer: RdmaWorker, region: SharedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No copy, no allocation, no staging on the step; the writer is handed the output's
    own memory, which its reference keeps after vLLM dropped the output."""
    gate = Gate(monkeypatch)
    first, second = plans(2)
    cache = {first.mm_hash: item(1), second.mm_hash: item(2)}
    addresses = [cache[p.mm_hash].data_ptr() for p in (first, second)]
    step(producer, region, [first], cache)
    assert gate.entered.wait(10)  # the writer is inside the first write

    def no_copy(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("a host save was copied on the step")

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", no_copy)
        m.setattr(torch.Tensor, "copy_", no_copy)
        m.setattr(torch.Tensor, "clone", no_copy)
        m.setattr(torch.Tensor, "contiguous", no_copy)
        step(producer, region, [second], cache)
    assert producer.writer is not None
    assert not producer.writer.staging.allocated
    assert producer.writer.held.held == 2 * ITEM_BYTES
    cache.clear()  # vLLM frees its outputs: the writer's references keep the bytes
    gate.opened.set()
    producer.flush()
    assert gate.handed == [(first.mm_hash, addresses[0]), (second.mm_hash, addresses[1])]
    assert producer.writer.held.held == 0
    assert_whole(region, first, item(1))
    assert_whole(region, second, item(2))


# ---- the staging path (device outputs), on a host tensor ----


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host outputs take the staging path, as device outputs do (copied into a lease)."""
    monkeypatch.setattr(RdmaWriter, "by_reference", staticmethod(lambda t: False))


@pytest.mark.usefixtures("staged")
def test_a_staged_output_is_copied_on_the_step_and_its_lease_freed_after_the_write(
    producer: RdmaWorker, region: SharedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    (plan,) = plans(1)
    out = item(4)
    want = raw(out)
    step(producer, region, [plan], {plan.mm_hash: out})
    out.zero_()  # a device output's block is reused once the copy read it
    assert producer.writer is not None
    limit = producer.writer.staging.limit_bytes
    assert producer.writer.staging.free_bytes == limit - 4096
    gate.opened.set()
    producer.flush()
    assert payload(region, plan) == want
    assert producer.writer.staging.free_bytes == limit


@pytest.mark.usefixtures("staged")
def test_the_writer_not_the_step_waits_for_the_device_copy(
    producer: RdmaWorker, region: SharedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on CUDA: the copy is still in flight when the step returns (its event not done);
    the writer thread waits for it, then writes the bytes it landed."""
    assert producer.writer is not None
    copies = CopiesInFlight(producer.writer.staging)
    monkeypatch.setattr(producer.writer, "_to_host", copies)
    (plan,) = plans(1)
    out = item(5)
    step(producer, region, [plan], {plan.mm_hash: out})
    assert state(region, plan) == (STATE_WRITING, plan.generation)
    copies.landed.set()
    producer.flush()
    assert copies.waited_on == ["ep-rdma-writer"]
    assert_whole(region, plan, out)


@pytest.mark.usefixtures("staged")
def test_a_device_copy_that_fails_drops_the_save_and_clears_the_mark(
    producer: RdmaWorker, region: SharedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert producer.writer is not None
    writer = producer.writer

    class Broken:
        def synchronize(self) -> None:
            raise RuntimeError("device lost")

        def query(self) -> bool:
            return False

    def broken_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, Any, Any] | None:
        lease = writer.staging.take(tensor.numel() * tensor.element_size(), pinned=False)
        assert lease is not None
        return lease.view(tensor.dtype, tuple(tensor.shape)), Broken(), lease

    monkeypatch.setattr(writer, "_to_host", broken_copy)
    (plan,) = plans(1)
    step(producer, region, [plan], {plan.mm_hash: item(6)})
    producer.flush()
    assert state(region, plan) != (STATE_WRITING, plan.generation)  # nobody waits for it
    assert header(region, plan) is None
    assert counters(producer) == {"saves_queued": 1, "saves_dropped": 1}


# ---- exhaustion drops and counts ----


@pytest.mark.parametrize("path", ["by_reference", "staged"])
def test_saves_past_the_staging_limit_are_dropped_counted_and_unmarked(
    shm_dir: str, region: SharedRegion, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Four 4 KiB outputs fit 16 KiB; with the writer held inside the first, the fifth is
    dropped on the step (nothing allocated, nothing waited for) and its slot unmarked."""
    if path == "staged":
        monkeypatch.setattr(RdmaWriter, "by_reference", staticmethod(lambda t: False))
    monkeypatch.setattr(worker_module, "DEFAULT_SAVE_STAGING_BYTES", 16 * KiB)
    w = RdmaWorker(rdma_config(shm_dir), is_producer=True, is_consumer=False)
    w._device = torch.device("cpu")
    try:
        gate = Gate(monkeypatch)
        writes = plans(6)
        cache = {p.mm_hash: item(i) for i, p in enumerate(writes)}
        step(w, region, writes[:4], cache)
        assert gate.entered.wait(10)
        step(w, region, writes[4:5], cache)
        assert counters(w) == {"saves_queued": 4, "saves_dropped": 1, "saves_dropped_staging": 1}
        assert state(region, writes[4]) is None  # cleared: the scheduler will not wait
        gate.opened.set()
        w.flush()
        step(w, region, writes[5:], cache)  # the written saves' bytes serve again
        w.flush()
        for plan in writes[:4] + writes[5:]:
            assert_whole(region, plan, cache[plan.mm_hash])
        assert header(region, writes[4]) is None
    finally:
        w.shutdown()


def test_a_full_writer_queue_drops_and_counts_and_never_blocks_the_step(
    producer: RdmaWorker, region: SharedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert producer.writer is not None
    producer.writer.close()
    producer.writer = RdmaWriter(
        producer._region_lock, producer.stats, stale_s=30.0, staging_bytes=1 << 20, maxsize=1
    )
    gate = Gate(monkeypatch)
    writes = plans(4)
    cache = {p.mm_hash: item(i) for i, p in enumerate(writes)}
    step(producer, region, writes[:1], cache)
    assert gate.entered.wait(10)  # taken off the queue, inside its write
    step(producer, region, writes[1:], cache)  # one queued place: two dropped at once
    assert counters(producer) == {"saves_queued": 2, "saves_dropped": 2}
    assert [state(region, p) for p in writes[2:]] == [None, None]
    gate.opened.set()
    producer.flush()
    assert_whole(region, writes[0], cache["h0"])
    assert_whole(region, writes[1], cache["h1"])


def test_an_output_bigger_than_its_slot_is_dropped_on_the_step(
    producer: RdmaWorker, region: SharedRegion
) -> None:
    (plan,) = plans(1)
    step(producer, region, [plan], {plan.mm_hash: item(7, (2 * TOKENS, WIDTH))})
    producer.flush()
    assert counters(producer) == {"saves_dropped": 1}
    assert state(region, plan) is None


# ---- shutdown ----


def test_shutdown_writes_what_was_queued(
    producer: RdmaWorker, region: SharedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(monkeypatch)
    writes = plans(3)
    cache = {p.mm_hash: item(i) for i, p in enumerate(writes)}
    step(producer, region, writes, cache)
    assert gate.entered.wait(10)
    closing = threading.Thread(target=producer.shutdown)
    closing.start()
    gate.opened.set()
    closing.join(30)
    assert not closing.is_alive()
    for plan in writes:
        assert_whole(region, plan, cache[plan.mm_hash])
    assert producer.region is None


def test_saves_queued_for_an_unmapped_region_are_dropped_not_written(
    producer: RdmaWorker, region: SharedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker unmaps a region only between writes (the writer's lock); what was queued
    for it after that is dropped and counted, never written through a closed map."""
    gate = Gate(monkeypatch)
    unmapped = threading.Event()
    real_publish = RdmaWriter._publish

    def publish_after_the_unmap(self: RdmaWriter, item: Any) -> None:
        if item.mm_hash != "h0":  # the later saves reach the lock only after the unmap
            assert unmapped.wait(10)
        real_publish(self, item)

    monkeypatch.setattr(RdmaWriter, "_publish", publish_after_the_unmap)
    writes = plans(3)
    cache = {p.mm_hash: item(i) for i, p in enumerate(writes)}
    step(producer, region, writes, cache)
    assert gate.entered.wait(10)

    def unmap() -> None:
        producer._unmap()
        unmapped.set()

    unmapping = threading.Thread(target=unmap)
    unmapping.start()
    time.sleep(0.05)
    assert unmapping.is_alive()  # held by the write in progress
    gate.opened.set()
    unmapping.join(30)
    producer.flush()
    assert_whole(region, writes[0], cache["h0"])
    for plan in writes[1:]:
        assert header(region, plan) is None
    assert counters(producer) == {
        "saves_queued": 3,
        "saves": 1,
        "save_bytes": ITEM_BYTES,
        "saves_dropped": 2,
    }


# ---- announcing: the scheduler waits for the writer, boundedly ----


class _Resolver:
    def fields_for(self, modality: str) -> set[str]:
        return set()


@dataclass
class Req:
    request_id: str
    hashes: list[str]
    ec_transfer_params: dict[str, Any] | None = None
    mm_features: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.mm_features = [
            SimpleNamespace(
                identifier=h,
                modality="image",
                data=None,
                mm_position=SimpleNamespace(offset=i * 100, length=TOKENS),
            )
            for i, h in enumerate(self.hashes)
        ]

    def get_num_encoder_embeds(self, index: int) -> int:
        return TOKENS


@pytest.fixture
def side(shm_dir: str) -> Iterator[tuple[RdmaScheduler, RdmaWorker]]:
    """A producer's scheduler (real NIXL agent, unauthenticated) and worker."""
    cfg = rdma_config(shm_dir)
    sched = RdmaScheduler(
        cfg,
        is_producer=True,
        is_consumer=False,
        model_dtype="bfloat16",
        widths={"image": WIDTH},
        metadata_resolver=_Resolver(),
        advertise_host="127.0.0.1",
        channel_key=None,
    )
    w = RdmaWorker(cfg, is_producer=True, is_consumer=False)
    w._device = torch.device("cpu")
    yield sched, w
    w.shutdown()
    sched.shutdown()


def producer_of(sched: RdmaScheduler) -> Any:
    assert sched.producer is not None
    return sched.producer


def encode(sched: RdmaScheduler, w: RdmaWorker, req: Req, cache: dict[str, torch.Tensor]) -> None:
    """The request's step: plans, then the encoder's outputs queued (save_caches)."""
    assert sched.ensure_cache_available(req, 0)
    meta = sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={req.request_id: 1}))
    w.start_save_caches(cache, meta)
    for i, h in enumerate(req.hashes):
        if h not in cache:
            cache[h] = item(100 + i)
            w.save_caches(cache, h)


def rdma_of(params: dict[str, Any] | None, mm_hash: str) -> Any:
    assert params is not None
    return params[mm_hash]["encoderpool"].get("rdma")


def test_request_finished_waits_for_the_writer_and_announces_the_whole_item(
    side: tuple[RdmaScheduler, RdmaWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    sched, w = side
    gate = Gate(monkeypatch)
    cache: dict[str, torch.Tensor] = {}
    req = Req("r1", ["a-1", "a-2"])
    encode(sched, w, req, cache)  # the step returned; the writer is held
    assert gate.entered.wait(10)
    opener = threading.Timer(0.1, gate.opened.set)
    opener.start()
    params = sched.request_finished(req)  # waits until the writer wrote both
    opener.join()
    for h in req.hashes:
        coords = rdma_of(params, h)
        assert coords is not None
        assert coords["checksum"] == "blake3:" + blake3.blake3(raw(cache[h])).hexdigest()
    stats = sched.stats.take()
    assert stats is not None
    assert stats.data["announced"] == 2
    assert stats.data["announce_wait_seconds"] > 0
    assert "announce_waits_timed_out" not in stats.data


def test_a_write_outliving_the_wait_is_unannounced_and_its_slot_kept_until_it_ends(
    side: tuple[RdmaScheduler, RdmaWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past PUBLISH_WAIT_S the item is a miss for consumers (no coordinates), but the slot
    is not freed under the write still to land; once written it serves a repeat."""
    monkeypatch.setattr(scheduler_producer, "PUBLISH_WAIT_S", 0.05)
    sched, w = side
    gate = Gate(monkeypatch)
    cache: dict[str, torch.Tensor] = {}
    req = Req("r1", ["b-1"])
    encode(sched, w, req, cache)
    assert gate.entered.wait(10)
    params = sched.request_finished(req)
    assert rdma_of(params, "b-1") is None
    stats = sched.stats.take()
    assert stats is not None
    assert stats.data["announce_waits_timed_out"] == 1
    assert stats.data["unannounced"] == 1
    slot = producer_of(sched)._slots["b-1"]
    assert slot is not None
    assert allocated(sched, slot)  # kept: the write may still land
    sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert allocated(sched, slot)  # still writing: still kept
    gate.opened.set()
    w.flush()
    sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert allocated(sched, slot)
    assert not slot.locked  # written: evictable, and a repeat of the item announces it
    again = Req("r2", ["b-1"])
    encode(sched, w, again, cache)  # in vLLM's encoder cache: nothing queued again
    coords = rdma_of(sched.request_finished(again), "b-1")
    assert coords is not None
    assert coords["checksum"] == "blake3:" + blake3.blake3(raw(cache["b-1"])).hexdigest()


def test_after_a_wait_timed_out_the_next_requests_do_not_wait_for_a_writer_behind(
    side: tuple[RdmaScheduler, RdmaWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stuck writer holds the engine loop for one wait per BEHIND_S, not one per request:
    the requests finishing after a timed-out wait are unannounced without waiting."""
    monkeypatch.setattr(scheduler_producer, "PUBLISH_WAIT_S", 0.2)
    sched, w = side
    gate = Gate(monkeypatch)
    cache: dict[str, torch.Tensor] = {}
    first, second = Req("r1", ["b-1"]), Req("r2", ["b-2"])
    encode(sched, w, first, cache)
    assert gate.entered.wait(10)
    encode(sched, w, second, cache)  # queued behind the held write
    assert rdma_of(sched.request_finished(first), "b-1") is None
    t0 = time.monotonic()
    assert rdma_of(sched.request_finished(second), "b-2") is None
    assert time.monotonic() - t0 < 0.1  # no second 0.2 s wait
    stats = sched.stats.take()
    assert stats is not None
    assert stats.data["announce_waits_timed_out"] == 2
    assert stats.data["unannounced"] == 2
    gate.opened.set()
    w.flush()


def test_a_dropped_save_is_unannounced_at_once_and_its_slot_freed(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No mark, no wait: a save the step could not queue is an unwritten slot, as before."""
    monkeypatch.setattr(worker_module, "DEFAULT_SAVE_STAGING_BYTES", 4 * KiB)
    monkeypatch.setattr(scheduler_producer, "PUBLISH_WAIT_S", 30.0)
    cfg = rdma_config(shm_dir)
    sched = RdmaScheduler(
        cfg,
        is_producer=True,
        is_consumer=False,
        model_dtype="bfloat16",
        widths={"image": WIDTH},
        metadata_resolver=_Resolver(),
        advertise_host="127.0.0.1",
        channel_key=None,
    )
    w = RdmaWorker(cfg, is_producer=True, is_consumer=False)
    w._device = torch.device("cpu")
    try:
        gate = Gate(monkeypatch)
        cache: dict[str, torch.Tensor] = {}
        first = Req("r1", ["c-1"])
        encode(sched, w, first, cache)
        assert gate.entered.wait(10)  # 4 KiB held by the writer: the limit
        second = Req("r2", ["c-2"])
        encode(sched, w, second, cache)  # dropped on the step
        t0 = time.monotonic()
        assert rdma_of(sched.request_finished(second), "c-2") is None
        assert time.monotonic() - t0 < 10  # not the 30 s bound: nothing to wait for
        assert "c-2" not in producer_of(sched)._slots
        gate.opened.set()
        assert rdma_of(sched.request_finished(first), "c-1") is not None
        assert counters(w)["saves_dropped_staging"] == 1
    finally:
        w.shutdown()
        sched.shutdown()


def test_stale_saves_are_dropped_by_the_writer_and_unmarked(
    producer: RdmaWorker, region: SharedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that waited past half the slot TTL is not written: the scheduler frees
    slots by age after the whole TTL, so its range may belong to another item by then."""
    assert producer.writer is not None
    monkeypatch.setattr(producer.writer, "stale_s", 0.0)
    (plan,) = plans(1)
    step(producer, region, [plan], {plan.mm_hash: item(8)})
    producer.flush()
    assert header(region, plan) is None
    assert state(region, plan) is None
    assert counters(producer) == {"saves_queued": 1, "saves_dropped": 1}
    assert producer.writer.held.held == 0


def allocated(sched: Any, slot: Any) -> bool:
    """The allocator still holds ``slot`` itself at its offset."""
    return sched.alloc.get(slot.offset) is slot
