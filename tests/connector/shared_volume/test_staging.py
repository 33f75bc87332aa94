"""Saves through the writer: a host output is queued by reference (no copy on the step, no
staging memory), bounded by the same limit; a device output is staged through the bounded
pool (``core.staging``). Either way a full queue or pool drops the save and counts it,
never allocates; bytes are reused only after their entry was written; a dropped save is a
miss for consumers. The staging path runs here on host tensors through ``staged`` (as a
device output would take it), and the CUDA copy paths (``core.streams``) against
stand-ins for torch.cuda's streams and events, for their order of calls."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from encoderpool_connector.core import streams
from encoderpool_connector.core.staging import ALIGN, StagingPool
from encoderpool_connector.shared_volume.entry import Header, entry_name, read_prefix
from encoderpool_connector.shared_volume.store import PublishResult, SharedStore
from encoderpool_connector.shared_volume.worker import BackgroundWriter, writer_stats
from encoderpool_contracts import Announcement, ConnectorConfig
from tests.connector.fixtures import CopiesInFlight
from tests.connector.shared_volume.fixtures import FP

KiB = 1 << 10
ITEM = (16, 256)  # bfloat16: 8 KiB, two pages of the pool


class Gate:
    """Makes the store's publish block until ``open`` (a writer behind on a slow volume)."""

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.seen: list[bytes] = []  # the payload bytes each publish was handed
        self.addresses: list[int] = []  # and where they were in memory
        self._real = store.publish

    def publish(self, name: str, header: Header, payload: memoryview) -> PublishResult:
        self.entered.set()
        assert self.opened.wait(30)
        self.seen.append(bytes(payload))
        self.addresses.append(np.frombuffer(payload, dtype=np.uint8).ctypes.data)
        return self._real(name, header, payload)


@pytest.fixture
def store(tmp_path: Path) -> SharedStore:
    s = SharedStore(str(tmp_path), 1 << 30, "lru")
    s.prepare_producer()
    return s


@pytest.fixture
def gated(store: SharedStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    gate = Gate(store)
    monkeypatch.setattr(store, "publish", gate.publish)
    yield gate
    gate.opened.set()  # never leave the writer blocked


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host outputs take the staging path, as device outputs do (copied into a lease)."""
    monkeypatch.setattr(BackgroundWriter, "by_reference", staticmethod(lambda t: False))


def writer_for(store: SharedStore, staging_bytes: int) -> BackgroundWriter:
    return BackgroundWriter(store, FP, 64, writer_stats(), staging_bytes=staging_bytes)


def item(seed: int, shape: tuple[int, int] = ITEM) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def published(store: SharedStore, mm_hash: str) -> bytes | None:
    """The payload of the published entry of ``mm_hash``, or None if there is none."""
    try:
        fd = os.open(store.entry_path(entry_name(FP, mm_hash)), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        header, offset = read_prefix(fd)
        return os.pread(fd, header.payload_bytes, offset)
    finally:
        os.close(fd)


def raw_size(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


def counters(writer: BackgroundWriter) -> dict[str, Any]:
    return dict(writer.stats.totals.data)


# ---- the pool alone ----


def test_leases_are_disjoint_aligned_and_merge_back_into_one_range() -> None:
    pool = StagingPool(64 * KiB)
    leases = [pool.take(n, pinned=False) for n in (1, ALIGN, ALIGN + 1, 10 * KiB)]
    assert all(lease is not None for lease in leases)
    spans = sorted((lease.offset, lease.offset + lease.size) for lease in leases if lease)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    assert all(start % ALIGN == 0 for start, _ in spans)
    for lease in (leases[1], leases[3], leases[0], leases[2]):  # out of order
        assert lease is not None
        pool.give_back(lease)
    assert pool.free_bytes == pool.largest_free == 64 * KiB


def test_an_exhausted_pool_refuses_and_allocates_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = StagingPool(32 * KiB)
    first = pool.take(16 * KiB, pinned=False)
    second = pool.take(16 * KiB, pinned=False)
    assert first is not None
    assert second is not None
    region = pool._region

    def no_allocation(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("the pool allocated after its region existed")

    monkeypatch.setattr(torch, "empty", no_allocation)
    assert pool.take(1, pinned=False) is None
    pool.give_back(first)
    again = pool.take(16 * KiB, pinned=False)
    assert again is not None
    assert again.offset == first.offset  # the same bytes, reused
    assert pool._region is region


def test_a_save_bigger_than_the_pool_is_refused_before_anything_is_allocated() -> None:
    pool = StagingPool(32 * KiB)
    assert pool.take(32 * KiB + 1, pinned=False) is None
    assert not pool.allocated  # not even the region: that save could never fit
    assert pool.take(32 * KiB, pinned=False) is not None


def test_a_lease_given_back_during_its_copy_is_reused_only_once_the_copy_is_done() -> None:
    pool = StagingPool(8 * KiB)
    lease = pool.take(8 * KiB, pinned=False)
    assert lease is not None
    copy = SimpleNamespace(done=False)
    pool.give_back(lease, after=SimpleNamespace(query=lambda: copy.done))
    assert pool.take(1, pinned=False) is None
    copy.done = True
    assert pool.take(8 * KiB, pinned=False) is not None


def test_a_region_that_cannot_be_allocated_drops_every_save_without_retrying(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def failing(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs)
        raise RuntimeError("out of pinned memory")

    monkeypatch.setattr(torch, "empty", failing)
    pool = StagingPool(32 * KiB)
    assert pool.take(KiB, pinned=True) is None
    assert pool.take(KiB, pinned=True) is None
    assert len(calls) == 1
    assert calls[0]["pin_memory"] is True


# ---- through the writer ----


@pytest.mark.usefixtures("staged")
def test_saves_past_the_pool_are_dropped_and_counted_while_the_writer_is_behind(
    store: SharedStore, gated: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four 8 KiB outputs fit a 32 KiB pool; the writer holds the first inside its write,
    so the fifth is refused, with nothing allocated, until a write finished."""
    writer = writer_for(store, 32 * KiB)
    try:
        items = {f"h{i}": item(i) for i in range(6)}
        assert all(writer.submit(h, items[h]) for h in ("h0", "h1", "h2", "h3"))
        assert gated.entered.wait(10)
        region = writer.staging._region

        def no_allocation(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise AssertionError("a save allocated on the step")

        monkeypatch.setattr(torch, "empty", no_allocation)
        assert not writer.submit("h4", items["h4"])
        assert counters(writer) == {
            "saves_queued": 4,
            "saves_dropped": 1,
            "saves_dropped_staging": 1,
        }
        assert writer.staging._region is region
        gated.opened.set()
        writer.flush()
        assert writer.submit("h5", items["h5"])  # the written saves' bytes serve again
        writer.flush()
        for h in ("h0", "h1", "h2", "h3", "h5"):
            assert published(store, h) == raw(items[h])
        assert published(store, "h4") is None
        assert writer.staging.free_bytes == 32 * KiB
    finally:
        writer.close()


@pytest.mark.usefixtures("staged")
def test_a_buffer_is_never_reused_before_its_write_finished(
    store: SharedStore, gated: Gate
) -> None:
    """A pool of exactly one item: while the writer is inside the write of the first save,
    every other save is refused, so the bytes it writes are the first save's own."""
    writer = writer_for(store, 8 * KiB)
    try:
        first = item(1)
        assert writer.submit("first", first)
        assert gated.entered.wait(10)
        for i in range(5):
            assert not writer.submit(f"other{i}", item(10 + i))
        assert writer.staging.free_bytes == 0
        gated.opened.set()
        writer.flush()
        assert gated.seen == [raw(first)]
        assert published(store, "first") == raw(first)
        assert writer.staging.free_bytes == 8 * KiB
        second = item(2)
        assert writer.submit("second", second)
        writer.flush()
        assert published(store, "second") == raw(second)
        assert counters(writer)["saves_dropped_staging"] == 5
    finally:
        writer.close()


@pytest.mark.usefixtures("staged")
def test_an_output_bigger_than_the_pool_is_dropped_and_counted_not_allocated(
    store: SharedStore,
) -> None:
    writer = writer_for(store, 32 * KiB)
    try:
        assert not writer.submit("huge", item(0, (64, 512)))  # 64 KiB
        assert counters(writer) == {"saves_dropped": 1, "saves_dropped_staging": 1}
        assert not writer.staging.allocated
        assert writer.submit("fits", item(1))
        writer.flush()
        assert published(store, "huge") is None
        assert published(store, "fits") == raw(item(1))
    finally:
        writer.close()


@pytest.mark.usefixtures("staged")
def test_a_staged_save_is_copied_on_the_step_so_later_changes_to_the_output_do_not_leak(
    store: SharedStore, gated: Gate
) -> None:
    writer = writer_for(store, 32 * KiB)
    try:
        out = item(7)
        want = raw(out)
        assert writer.submit("h", out)
        out.zero_()  # a device output's block is reused once the copy read it
        gated.opened.set()
        writer.flush()
        assert published(store, "h") == want
    finally:
        writer.close()


@pytest.mark.usefixtures("staged")
def test_the_writer_waits_for_the_copy_s_event_and_only_then_writes_and_frees(
    store: SharedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on CUDA: ``_to_host`` returns before the bytes landed, with an event; the writer
    thread (never the step) waits for it, writes, and gives the lease back after."""
    writer = writer_for(store, 8 * KiB)
    copies = CopiesInFlight(writer.staging)
    monkeypatch.setattr(writer, "_to_host", copies)
    try:
        out = item(3)
        assert writer.submit("h", out)  # returns with the copy still in flight
        assert not writer.submit("other", item(4))  # its bytes are still lent
        copies.landed.set()
        writer.flush()
        assert copies.waited_on == ["ep-writer"]
        assert published(store, "h") == raw(out)
        assert writer.staging.free_bytes == 8 * KiB
    finally:
        writer.close()


def test_a_save_staged_then_refused_by_a_full_queue_frees_its_bytes_after_its_copy(
    store: SharedStore,
) -> None:
    writer = BackgroundWriter(store, FP, 1, writer_stats(), staging_bytes=32 * KiB)
    copy = SimpleNamespace(done=False)
    ready = SimpleNamespace(query=lambda: copy.done)
    lease = writer.staging.take(8 * KiB, pinned=False)
    assert lease is not None
    # The race submit guards against: queued after its check, a copy already in flight.
    writer.staging.give_back(lease, after=ready)
    assert writer.staging.largest_free == 24 * KiB
    copy.done = True
    assert writer.staging.take(32 * KiB, pinned=False) is not None
    writer.close()


# ---- host outputs, held by reference ----


def test_a_cpu_save_is_queued_by_reference_and_written_from_the_output_s_own_memory(
    store: SharedStore, gated: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step only queues: it returns while the writer has not touched the output, no
    staging memory is taken or allocated, and the entry is written from the output's
    own bytes (no copy anywhere for a contiguous output)."""
    writer = writer_for(store, 32 * KiB)
    try:
        first, second = item(1), item(2)
        assert writer.submit("first", first)
        assert gated.entered.wait(10)  # the writer is inside the first write

        def no_copy(*args: Any, **kwargs: Any) -> torch.Tensor:
            raise AssertionError("a host save was copied on the step")

        with monkeypatch.context() as m:
            m.setattr(torch, "empty", no_copy)
            m.setattr(torch.Tensor, "copy_", no_copy)
            m.setattr(torch.Tensor, "clone", no_copy)
            assert writer.submit("second", second)
        assert published(store, "second") is None  # the step returned before any write
        assert not writer.staging.allocated
        assert writer.staging.free_bytes == 0
        assert writer.held.held == 2 * raw_size(first)
        gated.opened.set()
        writer.flush()
        assert gated.addresses == [first.data_ptr(), second.data_ptr()]
        assert published(store, "first") == raw(first)
        assert published(store, "second") == raw(second)
        assert writer.held.held == 0
        assert counters(writer)["saves_queued"] == 2
    finally:
        writer.close()


def test_a_cpu_output_vllm_frees_after_the_step_is_still_written_whole(
    store: SharedStore, gated: Gate
) -> None:
    """vLLM frees an encoder output by dropping the cache's reference (``pop``): the
    writer's own reference keeps the bytes until the entry is written."""
    writer = writer_for(store, 32 * KiB)
    try:
        cache = {"h": item(5)}
        want = raw(cache["h"])
        assert writer.submit("h", cache["h"])
        cache.pop("h")
        gated.opened.set()
        writer.flush()
        assert published(store, "h") == want
    finally:
        writer.close()


def test_a_non_contiguous_cpu_output_is_made_contiguous_by_the_writer(
    store: SharedStore, gated: Gate
) -> None:
    writer = writer_for(store, 32 * KiB)
    try:
        out = item(6, (ITEM[1], ITEM[0])).t()  # a view: the writer, not the step, copies it
        assert not out.is_contiguous()
        assert writer.submit("h", out)
        gated.opened.set()
        writer.flush()
        assert published(store, "h") == raw(out)
    finally:
        writer.close()


def test_cpu_saves_past_the_limit_are_dropped_and_counted_while_the_writer_is_behind(
    store: SharedStore, gated: Gate
) -> None:
    """Referenced outputs count against the staging limit as staged ones do: four 8 KiB
    outputs fit 32 KiB, the fifth is dropped until a write finished."""
    writer = writer_for(store, 32 * KiB)
    try:
        items = {f"h{i}": item(i) for i in range(6)}
        assert all(writer.submit(h, items[h]) for h in ("h0", "h1", "h2", "h3"))
        assert gated.entered.wait(10)
        assert not writer.submit("h4", items["h4"])
        assert counters(writer) == {
            "saves_queued": 4,
            "saves_dropped": 1,
            "saves_dropped_staging": 1,
        }
        assert writer.held.held == 32 * KiB
        gated.opened.set()
        writer.flush()
        assert writer.held.held == 0
        assert writer.submit("h5", items["h5"])
        writer.flush()
        for h in ("h0", "h1", "h2", "h3", "h5"):
            assert published(store, h) == raw(items[h])
        assert published(store, "h4") is None
        assert not writer.staging.allocated
    finally:
        writer.close()


def test_a_cpu_output_bigger_than_the_limit_is_dropped_and_counted(store: SharedStore) -> None:
    writer = writer_for(store, 32 * KiB)
    try:
        assert not writer.submit("huge", item(0, (64, 512)))  # 64 KiB
        assert counters(writer) == {"saves_dropped": 1, "saves_dropped_staging": 1}
        assert writer.held.held == 0
        assert writer.submit("fits", item(1))
        writer.flush()
        assert published(store, "huge") is None
        assert published(store, "fits") == raw(item(1))
    finally:
        writer.close()


def test_a_full_queue_drops_a_cpu_save_and_holds_nothing_for_it(
    store: SharedStore, gated: Gate
) -> None:
    writer = BackgroundWriter(store, FP, 1, writer_stats(), staging_bytes=32 * KiB)
    try:
        assert writer.submit("h0", item(0))
        assert gated.entered.wait(10)  # taken off the queue, inside its write
        assert writer.submit("h1", item(1))  # the one queued place
        assert not writer.submit("h2", item(2))
        assert counters(writer) == {"saves_queued": 2, "saves_dropped": 1}
        assert writer.held.held == 2 * 8 * KiB
        gated.opened.set()
        writer.flush()
        assert writer.held.held == 0
        assert published(store, "h2") is None
    finally:
        writer.close()


# ---- a dropped save, as consumers see it ----


def consumer_scheduler(root: Path, wait_ms: int) -> Any:
    from encoderpool_connector.shared_volume.scheduler import SharedVolumeScheduler

    config = ConnectorConfig.from_extra_config(
        {
            "transport": "sharedVolume",
            "model_fingerprint": FP,
            "encoder_output_widths": {"image": ITEM[1]},
            "shared_volume": {
                "root": str(root),
                "capacity_bytes": 1 << 30,
                "publish_wait_ms": wait_ms,
            },
        }
    )
    return SharedVolumeScheduler(
        config,
        SharedStore(str(root), 1 << 30, "lru"),
        is_producer=False,
        is_consumer=True,
        model_dtype="bfloat16",
        widths=dict(config.encoder_output_widths),
        metadata_resolver=None,
    )


def request_for(mm_hash: str, announced: bool) -> SimpleNamespace:
    feature = SimpleNamespace(identifier=mm_hash, modality="image")
    params = {mm_hash: {"encoderpool": Announcement(fingerprint=FP).to_wire()}}
    return SimpleNamespace(
        mm_features=[feature],
        ec_transfer_params=params if announced else None,
        get_num_encoder_embeds=lambda i: ITEM[0],
    )


def test_a_save_dropped_for_staging_is_a_miss_for_consumers_never_an_entry(
    tmp_path: Path, store: SharedStore
) -> None:
    """No entry, no temp file left behind: a consumer's lookup is a miss (after the wait for
    an announced item, as for any save the producer could not publish)."""
    writer = writer_for(store, 8 * KiB)
    try:
        assert not writer.submit("dropped", item(0, (32, 256)))  # 16 KiB > the pool
        writer.flush()
    finally:
        writer.close()
    assert not store.exists(entry_name(FP, "dropped"))
    assert os.listdir(tmp_path / "tmp") == []
    sched = consumer_scheduler(tmp_path, wait_ms=0)
    try:
        assert sched._start(request_for("dropped", announced=False), 0).state == "miss"
        lookup = sched._start(request_for("dropped", announced=True), 0)
        assert lookup.state == "waiting"
        assert sched._advance("dropped", lookup)  # publish_wait_ms passed: decided
        assert lookup.state == "miss"
        assert sched.stats.data["misses"] == 2
        assert sched.stats.data.get("hits", 0) == 0
    finally:
        sched.shutdown()


# ---- the CUDA copy paths, against stand-ins for torch.cuda ----


class FakeStream:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(f"{self.name} waits {event.name}")

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits stream {other.name}")

    def synchronize(self) -> None:
        self.log.append(f"{self.name} synchronize")


class FakeEvent:
    count = 0

    def __init__(self, log: list[str], blocking: bool = False) -> None:
        FakeEvent.count += 1
        self.log, self.name, self.blocking = log, f"e{FakeEvent.count}", blocking
        self.recorded_on: str | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded_on = stream.name if stream else "current"
        self.log.append(f"{self.name} recorded on {self.recorded_on}")

    def query(self) -> bool:
        return self.recorded_on is not None


class DeviceOutput(torch.Tensor):  # type: ignore[misc]  # torch is untyped here
    """A CPU tensor that logs ``record_stream`` (what a CUDA output would be asked)."""

    log: list[str]

    def record_stream(self, stream: Any) -> None:
        self.log.append(f"output used on {stream.name}")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    log: list[str] = []
    current = FakeStream(log, "current")
    FakeEvent.count = 0

    class Ctx:
        def __init__(self, stream: FakeStream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            log.append(f"enter {self.stream.name}")

        def __exit__(self, *exc: object) -> None:
            log.append(f"leave {self.stream.name}")

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "Stream", lambda device=None: FakeStream(log, "side"))
    monkeypatch.setattr(cuda, "Event", lambda blocking=False: FakeEvent(log, blocking))
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "stream", Ctx)
    return log


def test_a_device_save_is_copied_on_the_side_stream_after_the_encoder_s_work(
    fake_cuda: list[str],
) -> None:
    src = item(5).as_subclass(DeviceOutput)
    src.log = fake_cuda
    pool = StagingPool(32 * KiB)
    lease = pool.take(src.numel() * src.element_size(), pinned=False)
    assert lease is not None
    host = lease.view(src.dtype, tuple(src.shape))
    done = streams.SaveCopies().start(host, src)
    assert fake_cuda == [
        "e1 recorded on current",  # the encoder's work so far
        "side waits e1",
        "output used on side",  # before the copy: its block is kept until the copy ran
        "enter side",
        "e2 recorded on side",
        "leave side",
    ]
    assert done.blocking  # the writer thread sleeps while it waits
    assert done.recorded_on == "side"
    assert raw(host) == raw(src)


def test_a_device_load_is_uploaded_on_the_side_stream_and_the_model_waits_on_the_device(
    fake_cuda: list[str],
) -> None:
    uploads = streams.DeviceUploads(torch.device("cpu"))
    host = item(6)
    out = uploads.start(host)
    assert fake_cuda == [
        "side waits stream current",  # the block may be in use by work queued there
        "enter side",
        "e1 recorded on side",
        "leave side",
        "current waits e1",  # on the device: no host wait
    ]
    assert raw(out) == raw(host)
    assert uploads.in_flight == 1  # host is held until the copy's event reports done
    uploads.reap()
    assert uploads.in_flight == 0  # its event reported done: the staging buffer is free


def test_a_producer_worker_counts_a_staging_drop_in_its_report(
    tmp_path: Path, store: SharedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from encoderpool_connector.shared_volume import worker as worker_module

    monkeypatch.setattr(worker_module, "DEFAULT_SAVE_STAGING_BYTES", 16 * KiB)
    config = ConnectorConfig.from_extra_config(
        {
            "transport": "sharedVolume",
            "model_fingerprint": FP,
            "shared_volume": {"root": str(tmp_path), "capacity_bytes": 1 << 30},
        }
    )
    w = worker_module.SharedVolumeWorker(config, store, is_producer=True, is_consumer=False)
    try:
        cache = {"small": item(1), "big": item(2, (64, 256))}  # 8 KiB, 32 KiB
        w.save_caches(cache, "small")
        w.save_caches(cache, "big")
        assert w.writer is not None
        w.writer.flush()
        report = w.build_connector_worker_meta()
        assert report is not None
        assert report.stats["saves_dropped_staging"] == 1
        assert report.stats["saves_dropped"] == 1
        assert report.stats["published"] == 1
        assert published(store, "big") is None
    finally:
        w.shutdown()


@pytest.mark.alone  # times a thread's sleep in milliseconds: starved beside other suites
def test_the_writer_lets_a_burst_of_saves_finish_but_never_waits_long(
    store: SharedStore,
) -> None:
    """While saves keep coming the writer sleeps (the GIL free for the step), at most
    WRITER_QUIET_MAX_S; after a quiet moment it starts at once."""
    from encoderpool_connector.core import savequeue

    writer = writer_for(store, 32 * KiB)
    try:
        t0 = time.monotonic()
        writer._let_the_step_finish()  # nothing submitted lately
        assert time.monotonic() - t0 < savequeue.WRITER_QUIET_S
        stop = threading.Event()

        def submitting() -> None:
            while not stop.is_set():
                writer._last_submit = time.monotonic()
                time.sleep(0.0005)

        busy = threading.Thread(target=submitting)
        busy.start()
        try:
            t0 = time.monotonic()
            writer._let_the_step_finish()
            waited = time.monotonic() - t0
        finally:
            stop.set()
            busy.join()
        assert savequeue.WRITER_QUIET_MAX_S <= waited < 1
    finally:
        writer.close()
