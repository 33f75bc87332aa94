"""Large payloads read in parts on several threads (``split.py``): the same bytes as one read,
every failure of any part a miss, the buffer and fd held until every part is done, and
one persistent helper per reader, never a thread per load."""

from __future__ import annotations

import errno
import gc
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from encoderpool_connector.core.loadbuffers import LoadBuffers
from encoderpool_connector.shared_volume import split
from encoderpool_connector.shared_volume.entry import EntryError, read_payload
from encoderpool_connector.shared_volume.metadata import SharedVolumeMetadata
from encoderpool_connector.shared_volume.split import MIN_SPLIT_BYTES, SplitReader, default_threads
from encoderpool_connector.shared_volume.store import Pins, SharedStore
from encoderpool_connector.shared_volume.worker import SharedVolumeWorker
from encoderpool_contracts import ConnectorConfig
from tests.connector.shared_volume.fixtures import FP, put, spec_for

MiB = 1 << 20
OFFSET = 64  # where an entry's payload starts for a short header


def is_helper() -> bool:
    return threading.current_thread().name.startswith("ep-load-")


@pytest.fixture
def reader() -> Iterator[SplitReader]:
    r = SplitReader(2)
    yield r
    r.close()


def fail_reads_in_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every part the helper thread reads fails with EIO; the loading thread's parts read."""
    real = read_payload

    def failing_in_helper(*args: Any) -> None:
        if is_helper():
            raise OSError(errno.EIO, "injected I/O error")
        real(*args)

    monkeypatch.setattr(split, "read_payload", failing_in_helper)


def write_file(path: Path, nbytes: int, seed: int = 0, offset: int = OFFSET) -> bytes:
    payload = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    path.write_bytes(b"h" * offset + payload)
    return payload


def read_with(reader: SplitReader, path: Path, nbytes: int, offset: int = OFFSET) -> np.ndarray:
    out = np.full(nbytes, 0xAA, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        reader.read(fd, out, offset, nbytes)
    finally:
        os.close(fd)
    return out


@pytest.mark.parametrize(
    "nbytes",
    [
        MIN_SPLIT_BYTES - 1,
        MIN_SPLIT_BYTES,
        MIN_SPLIT_BYTES + 1,
        MIN_SPLIT_BYTES + 12_345,  # odd: the last part is not a whole grain
        1300 * 3584 * 2,  # a real image embedding, 9.3 MB
        3 * MIN_SPLIT_BYTES + 7,
    ],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_split_read_gives_the_bytes_of_one_read(
    tmp_path: Path, nbytes: int, threads: int
) -> None:
    path = tmp_path / "entry"
    want = write_file(path, nbytes, seed=nbytes)
    one = np.zeros(nbytes, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_payload(fd, one, OFFSET, nbytes)
    finally:
        os.close(fd)
    reader = SplitReader(threads)
    try:
        got = read_with(reader, path, nbytes)
        assert got.tobytes() == want
        assert np.array_equal(got, one)
        split_expected = threads > 1 and nbytes >= MIN_SPLIT_BYTES
        assert len(reader.helper_threads) == (threads - 1 if split_expected else 0)
    finally:
        reader.close()


def test_an_odd_payload_offset_and_a_size_just_over_the_parts_read_the_same(
    tmp_path: Path, reader: SplitReader
) -> None:
    """Parts are cut relative to the payload, not the file: any offset works."""
    nbytes, offset = 2 * MIN_SPLIT_BYTES + 3, 4160 + 13
    path = tmp_path / "entry"
    want = write_file(path, nbytes, offset=offset)
    assert read_with(reader, path, nbytes, offset).tobytes() == want
    assert len(reader.helper_threads) == 1


@pytest.mark.parametrize(
    "keep",
    [OFFSET + 100, OFFSET + MIN_SPLIT_BYTES // 2 + 100, OFFSET + MIN_SPLIT_BYTES - 1],
    ids=["in-the-caller-s-part", "in-the-helper-s-part", "one-byte-short"],
)
def test_a_file_truncated_after_opening_fails_the_read_never_serves_zeros(
    tmp_path: Path, reader: SplitReader, keep: int
) -> None:
    """The verified size was checked at open; a file cut afterwards (by anyone with a
    link to it) ends early in some part: an EntryError, whichever part it is."""
    nbytes = MIN_SPLIT_BYTES
    path = tmp_path / "entry"
    write_file(path, nbytes)
    out = np.full(nbytes, 0xAA, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.truncate(path, keep)
        with pytest.raises(EntryError, match="ended early"):
            reader.read(fd, out, OFFSET, nbytes)
    finally:
        os.close(fd)
    assert len(reader.helper_threads) == 1  # it was the split path that refused


def test_an_error_in_the_helper_s_part_fails_the_read_and_the_helper_serves_on(
    tmp_path: Path, reader: SplitReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbytes = MIN_SPLIT_BYTES
    path = tmp_path / "entry"
    want = write_file(path, nbytes)
    fail_reads_in_helper(monkeypatch)
    with pytest.raises(OSError, match="injected"):
        read_with(reader, path, nbytes)
    helper = reader.helper_threads[0]
    monkeypatch.undo()  # the helper reads again
    assert read_with(reader, path, nbytes).tobytes() == want
    assert reader.helper_threads == [helper]
    assert helper.is_alive()


def test_an_unexpected_error_in_the_helper_is_an_entry_error(
    tmp_path: Path, reader: SplitReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "entry"
    write_file(path, MIN_SPLIT_BYTES)
    real = read_payload

    def broken_in_helper(*args: Any) -> None:
        if is_helper():
            raise ZeroDivisionError("a bug")
        real(*args)

    monkeypatch.setattr(split, "read_payload", broken_in_helper)
    with pytest.raises(EntryError, match=r"helper failed.*ZeroDivisionError"):
        read_with(reader, path, MIN_SPLIT_BYTES)


@pytest.mark.parametrize("caller_fails", [False, True])
def test_the_read_returns_and_the_buffer_is_freed_only_after_every_part(
    tmp_path: Path, reader: SplitReader, monkeypatch: pytest.MonkeyPatch, caller_fails: bool
) -> None:
    """Nothing may reuse the slot (or the fd number) while a helper still writes into it:
    even when the caller's own part fails at once, ``read`` waits for the helper's slow
    part, and the helper keeps no reference to the buffer afterwards."""
    nbytes = MIN_SPLIT_BYTES
    path = tmp_path / "entry"
    write_file(path, nbytes)
    real = read_payload
    finished: list[float] = []

    def slow_helper(*args: Any) -> None:
        if is_helper():
            time.sleep(0.3)
            real(*args)
            finished.append(time.monotonic())
        elif caller_fails:
            raise OSError(errno.EIO, "caller's part failed")
        else:
            real(*args)

    monkeypatch.setattr(split, "read_payload", slow_helper)
    pool = LoadBuffers(64 * MiB)
    array = pool.lend_array(nbytes)
    assert array is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        if caller_fails:
            with pytest.raises(OSError, match="caller's part"):
                reader.read(fd, array, OFFSET, nbytes)
        else:
            reader.read(fd, array, OFFSET, nbytes)
        returned = time.monotonic()
    finally:
        os.close(fd)
    assert finished, "read returned before the helper's part was done"
    assert finished[0] <= returned
    assert pool.free_slots == 0
    del array
    gc.collect()
    assert pool.free_slots == 1  # the helper holds nothing of it any more


@pytest.mark.parametrize("nbytes", [MIN_SPLIT_BYTES - 1, MIN_SPLIT_BYTES])
def test_meanwhile_runs_on_the_caller_after_its_part_and_its_result_is_returned(
    tmp_path: Path, reader: SplitReader, nbytes: int
) -> None:
    """The load makes its tensor in ``meanwhile``: on the calling thread, once the
    caller's own part is in the buffer (split or not), returned as the read's result."""
    path = tmp_path / "entry"
    want = write_file(path, nbytes)
    out = np.zeros(nbytes, dtype=np.uint8)
    seen: list[tuple[str, bytes]] = []

    def meanwhile() -> str:
        seen.append((threading.current_thread().name, out[:100].tobytes()))
        return "made"

    fd = os.open(path, os.O_RDONLY)
    try:
        assert reader.read_and(fd, out, OFFSET, nbytes, meanwhile) == "made"
    finally:
        os.close(fd)
    assert seen == [(threading.current_thread().name, want[:100])]
    assert out.tobytes() == want


def test_a_failing_meanwhile_still_waits_for_the_helper(
    tmp_path: Path, reader: SplitReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbytes = MIN_SPLIT_BYTES
    path = tmp_path / "entry"
    write_file(path, nbytes)
    real = read_payload
    finished: list[float] = []

    def slow_helper(*args: Any) -> None:
        real(*args)
        if is_helper():
            time.sleep(0.3)
            finished.append(time.monotonic())

    def meanwhile() -> None:
        raise RuntimeError("making the tensor failed")

    monkeypatch.setattr(split, "read_payload", slow_helper)
    out = np.zeros(nbytes, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(RuntimeError, match="making the tensor"):
            reader.read_and(fd, out, OFFSET, nbytes, meanwhile)
        returned = time.monotonic()
    finally:
        os.close(fd)
    assert finished
    assert finished[0] <= returned


def test_one_helper_is_made_once_and_reused_for_every_load(
    tmp_path: Path, reader: SplitReader
) -> None:
    nbytes = MIN_SPLIT_BYTES + 5
    path = tmp_path / "entry"
    want = write_file(path, nbytes)
    assert read_with(reader, path, nbytes).tobytes() == want
    helpers = reader.helper_threads
    assert len(helpers) == 1
    threads_after_first = threading.active_count()
    for _ in range(20):
        assert read_with(reader, path, nbytes).tobytes() == want
    assert reader.helper_threads == helpers
    assert threading.active_count() == threads_after_first
    reader.close()
    assert not helpers[0].is_alive()
    assert read_with(reader, path, nbytes).tobytes() == want  # alone after close
    assert reader.helper_threads == []


def test_two_threads_reading_at_once_share_the_helper_or_read_alone(
    tmp_path: Path, reader: SplitReader
) -> None:
    nbytes = MIN_SPLIT_BYTES + 1
    paths = [tmp_path / f"entry-{i}" for i in range(2)]
    wants = [write_file(p, nbytes, seed=i) for i, p in enumerate(paths)]
    bad: list[int] = []

    def loop(i: int) -> None:
        for _ in range(15):
            if read_with(reader, paths[i], nbytes).tobytes() != wants[i]:
                bad.append(i)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []
    assert len(reader.helper_threads) == 1


def test_one_thread_starts_no_helper(tmp_path: Path) -> None:
    reader = SplitReader(1)
    nbytes = 2 * MIN_SPLIT_BYTES
    path = tmp_path / "entry"
    want = write_file(path, nbytes)
    before = threading.active_count()
    assert read_with(reader, path, nbytes).tobytes() == want
    assert reader.helper_threads == []
    assert threading.active_count() == before


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 2), (5, 5), (16, split.MAX_THREADS)])
def test_the_default_follows_the_thread_s_cpu_affinity(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cpus: int, threads: int
) -> None:
    monkeypatch.setattr(split, "CGROUP_CPU_MAX", str(tmp_path / "absent"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert default_threads() == threads


@pytest.mark.parametrize(
    ("cpu_max", "threads"), [("max 100000", 8), ("250000 100000", 3), ("50000 100000", 1)]
)
def test_the_default_is_lowered_to_the_container_s_cpu_quota(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cpu_max: str, threads: int
) -> None:
    """A pod limited to a few CPUs on a big node still has every core in its mask."""
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    monkeypatch.setattr(split, "CGROUP_CPU_MAX", str(tmp_path / "cpu.max"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert default_threads() == threads


@pytest.mark.parametrize(
    ("nbytes", "parts"),
    [(MIN_SPLIT_BYTES, 2), (3 * split.MIN_PART_BYTES + 5, 3), (40 * MiB, 8)],
)
def test_more_threads_split_only_larger_payloads_further(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nbytes: int, parts: int
) -> None:
    """Each part is at least MIN_PART_BYTES: eight threads read a 6 MiB payload in two."""
    path = tmp_path / "entry"
    want = write_file(path, nbytes, seed=3)
    started: list[int] = []
    real = split._Helper.start

    def counting(helper: Any, job: Any) -> None:
        started.append(job.nbytes)
        real(helper, job)

    monkeypatch.setattr(split._Helper, "start", counting)
    reader = SplitReader(split.MAX_THREADS)
    try:
        assert read_with(reader, path, nbytes).tobytes() == want
        assert len(started) == parts - 1
        assert min(started) >= split.MIN_PART_BYTES - parts * split._PART_GRAIN  # grain rounding
    finally:
        reader.close()


def test_a_reader_refuses_a_bad_thread_count() -> None:
    for bad in (0, split.MAX_THREADS + 1):
        with pytest.raises(ValueError, match="threads"):
            SplitReader(bad)


# ---- through the worker ----


def make_worker(tmp_path: Path, load_threads: int | None) -> tuple[SharedVolumeWorker, SharedStore]:
    sv: dict[str, Any] = {"root": str(tmp_path), "capacity_bytes": 1 << 30}
    if load_threads is not None:
        sv["load_threads"] = load_threads
    config = ConnectorConfig.from_extra_config(
        {"transport": "sharedVolume", "model_fingerprint": FP, "shared_volume": sv}
    )
    store = SharedStore(str(tmp_path), 1 << 30, "lru")
    store.prepare_producer()
    worker = SharedVolumeWorker(config, store, is_producer=False, is_consumer=True)
    worker._device = torch.device("cpu")
    return worker, store


@pytest.mark.parametrize("load_threads", [None, 1, 2])
def test_the_worker_loads_large_entries_in_parts_as_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, load_threads: int | None
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    worker, store = make_worker(tmp_path, load_threads)
    shape = (1300, 3584)
    pins = Pins(store)
    try:
        for h in ("a", "b", "c"):
            want = put(store, h, *shape)
            cache: dict[str, torch.Tensor] = {}
            worker.start_load_caches(cache, SharedVolumeMetadata(loads=[spec_for(pins, h, shape)]))
            assert torch.equal(cache[h], want)
            del cache
        assert worker._reader is not None
        helpers = worker._reader.helper_threads
        assert len(helpers) == (0 if load_threads == 1 else 1)
        assert worker.stats.totals.data["loads"] == 3
    finally:
        worker.shutdown()
    assert not any(t.is_alive() for t in helpers)


def test_a_helper_s_failure_is_a_failed_load_encoded_instead_and_frees_the_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, store = make_worker(tmp_path, 2)
    shape = (1300, 3584)
    put(store, "a", *shape)
    pins = Pins(store)
    fail_reads_in_helper(monkeypatch)
    cache: dict[str, torch.Tensor] = {}
    encoder_inputs: dict[str, list[int]] = {}
    spec = spec_for(pins, "a", shape)
    spec = type(spec)(**{**spec.__dict__, "request_id": "r1", "index": 0})
    try:
        worker.start_load_caches(
            cache, SharedVolumeMetadata(loads=[spec], encoder_inputs=encoder_inputs)
        )
        assert "a" not in cache  # nothing half-read is served
        assert encoder_inputs == {"r1": [0]}  # the engine encodes it in this step
        report = worker.build_connector_worker_meta()
        assert report is not None
        assert report.failed == {"a"}
        gc.collect()
        assert worker._buffers is not None
        assert worker._buffers.free_slots == 1
    finally:
        worker.shutdown()


def test_a_file_cut_between_open_and_read_is_a_failed_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker checked the verified size at open; a truncation right after it (in the
    helper's half) fails the load instead of serving the rest as zeros."""
    worker, store = make_worker(tmp_path, 2)
    shape = (1300, 3584)
    put(store, "a", *shape)
    pins = Pins(store)
    spec = spec_for(pins, "a", shape)
    real_open = store.open_verified

    def open_then_cut(subdir: str, name: str, inode: tuple[int, int], size: int) -> int:
        fd = real_open(subdir, name, inode, size)
        os.truncate(os.path.join(pins.dir, name), size - 4096)  # the same inode
        return fd

    monkeypatch.setattr(store, "open_verified", open_then_cut)
    try:
        assert worker._load(spec) is None
        assert worker._reader is not None
        assert len(worker._reader.helper_threads) == 1
    finally:
        worker.shutdown()


def test_load_threads_is_validated_and_stays_out_of_the_rendered_config_when_unset(
    tmp_path: Path,
) -> None:
    worker, _ = make_worker(tmp_path, None)
    rendered = worker.config.to_extra_config()
    assert "load_threads" not in rendered["shared_volume"]
    worker.shutdown()
    for bad in (0, 9):
        with pytest.raises(ValueError, match="load_threads"):
            ConnectorConfig.from_extra_config(
                {**rendered, "shared_volume": {**rendered["shared_volume"], "load_threads": bad}}
            )
    ok = {**rendered, "shared_volume": {**rendered["shared_volume"], "load_threads": 3}}
    assert ConnectorConfig.from_extra_config(ok).to_extra_config() == ok
