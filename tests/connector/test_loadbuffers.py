"""The load buffer pool: bounded, reused, never aliasing what it handed out; and the
shared-volume worker's loads through it (a bad entry is still a miss or a failed load)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from encoderpool_connector.core.loadbuffers import MIN_POOLED_BYTES, LoadBuffers, as_tensor
from encoderpool_connector.shared_volume.entry import Expect, entry_name
from encoderpool_connector.shared_volume.metadata import SharedVolumeMetadata
from encoderpool_connector.shared_volume.store import Pins, SharedStore
from encoderpool_connector.shared_volume.worker import SharedVolumeWorker
from encoderpool_contracts import ConnectorConfig
from tests.connector.shared_volume.fixtures import FP, put, spec_for

MiB = 1 << 20


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = int(a.data_ptr()), int(b.data_ptr())
    return a0 < b0 + int(b.nbytes) and b0 < a0 + int(a.nbytes)


def test_a_freed_buffer_is_reused_without_growing() -> None:
    pool = LoadBuffers(16 * MiB)
    t = pool.take(3 * MiB)
    assert t is not None
    assert t.numel() == 3 * MiB
    assert t.dtype == torch.uint8
    first, held = t.data_ptr(), pool.held_bytes
    del t
    again = pool.take(3 * MiB)
    assert again is not None
    assert again.data_ptr() == first
    assert pool.held_bytes == held


def test_nothing_handed_out_is_reused_while_any_view_of_it_lives() -> None:
    """vLLM keeps the tensor (or slices of it) in its encoder cache; its bytes must stay."""
    pool = LoadBuffers(16 * MiB)
    t = pool.take(3 * MiB)
    assert t is not None
    t.fill_(7)
    kept = t.view(torch.bfloat16).view(1024, -1)[100:200]  # what a slice in vLLM looks like
    del t
    gc.collect()
    other = pool.take(3 * MiB)
    assert other is not None
    assert not overlaps(other, kept)
    other.fill_(1)
    assert bool((kept.view(torch.uint8) == 7).all())
    del kept, other
    assert pool.free_slots == 2  # both came back once nothing referenced them


def test_a_lent_buffer_is_shaped_shares_its_bytes_and_returns_only_when_all_views_die() -> None:
    """The load path: the tensor vLLM keeps and the array the read fills are the same
    bytes; a slice of the tensor keeps the slot lent; nothing stays behind after."""
    pool = LoadBuffers(16 * MiB)
    array = pool.lend_array(3 * MiB)
    assert array is not None
    tensor = as_tensor(array, torch.bfloat16, (1024, 1536))
    assert tensor.dtype == torch.bfloat16
    assert tensor.shape == (1024, 1536)
    assert array.nbytes == 3 * MiB
    assert array.ctypes.data == tensor.data_ptr()
    array[:] = 0x3F  # what the read writes, seen through the tensor
    assert float(tensor[5, 7]) == float(
        torch.tensor(0x3F3F, dtype=torch.int16).view(torch.bfloat16)
    )
    kept = tensor[100:200]
    del tensor, array
    gc.collect()
    assert pool.free_slots == 0  # the slice still holds the storage
    other = pool.take(3 * MiB)
    assert other is not None
    assert not overlaps(other, kept)
    del other, kept
    gc.collect()
    assert pool.free_slots == 2
    assert not pool._lent  # no ref is kept for a returned slot


def test_a_lent_array_made_a_tensor_later_stays_lent_while_either_lives() -> None:
    """The load path: ``lend_array`` first (the read fills it), ``as_tensor`` after; the
    slot comes back only when the array and the tensor over it are both gone."""
    pool = LoadBuffers(16 * MiB)
    array = pool.lend_array(3 * MiB)
    assert array is not None
    array[:] = 5
    tensor = as_tensor(array, torch.bfloat16, (1024, 1536))
    assert tensor.data_ptr() == array.ctypes.data
    assert bool((tensor.view(torch.uint8) == 5).all())
    del array
    gc.collect()
    assert pool.free_slots == 0  # the tensor's storage keeps the array
    del tensor
    gc.collect()
    assert pool.free_slots == 1
    unused = pool.lend_array(3 * MiB)  # an array never made a tensor (a failed read)
    assert unused is not None
    del unused
    assert pool.free_slots == 1


def test_the_pool_stays_within_its_limit_and_says_when_it_is_exhausted() -> None:
    pool = LoadBuffers(8 * MiB)
    lent = [pool.take(4 * MiB) for _ in range(2)]
    assert all(t is not None for t in lent)
    assert pool.held_bytes == 8 * MiB
    assert pool.take(4 * MiB) is None  # every slot lent and the limit reached
    assert pool.take(MIN_POOLED_BYTES - 1) is None  # small: never pooled
    assert not pool.serves(MIN_POOLED_BYTES - 1)
    assert pool.take(9 * MiB) is None  # larger than the whole pool
    assert pool.held_bytes == 8 * MiB
    lent.pop()
    assert pool.take(4 * MiB) is not None


def test_a_bigger_payload_replaces_free_slots_that_are_too_small() -> None:
    pool = LoadBuffers(8 * MiB)
    small = [pool.take(2 * MiB) for _ in range(4)]
    assert pool.held_bytes == 8 * MiB
    del small
    big = pool.take(6 * MiB)  # drops free 2 MiB slots to make room
    assert big is not None
    assert pool.held_bytes <= 8 * MiB
    assert pool.take(2 * MiB) is not None  # what is left still serves


def test_a_disabled_pool_serves_nothing() -> None:
    pool = LoadBuffers(0)
    assert pool.take(4 * MiB) is None
    assert pool.held_bytes == 0


# ---- the worker's loads ----


def make_worker(tmp_path: Path, limit: int) -> tuple[SharedVolumeWorker, SharedStore]:
    config = ConnectorConfig.from_extra_config(
        {
            "transport": "sharedVolume",
            "model_fingerprint": FP,
            "shared_volume": {
                "root": str(tmp_path),
                "capacity_bytes": 1 << 30,
                "load_buffer_bytes": limit,
            },
        }
    )
    store = SharedStore(str(tmp_path), 1 << 30, "lru")
    store.prepare_producer()
    worker = SharedVolumeWorker(config, store, is_producer=False, is_consumer=True)
    worker._device = torch.device("cpu")
    return worker, store


def test_loads_come_from_the_pool_and_stay_intact_while_cached(tmp_path: Path) -> None:
    worker, store = make_worker(tmp_path, 64 * MiB)
    shape = (512, 2048)  # 2 MiB of bf16
    want = {h: put(store, h, *shape) for h in ("a", "b", "c")}
    pins = Pins(store)
    cache: dict[str, torch.Tensor] = {}
    specs = [spec_for(pins, h, shape) for h in want]
    worker.start_load_caches(cache, SharedVolumeMetadata(loads=specs))
    for h, t in want.items():
        assert torch.equal(cache[h], t)
    buffers = worker._buffers
    assert buffers is not None
    assert buffers.free_slots == 0
    # vLLM frees "a"; the next load reuses its memory and leaves "b" and "c" alone.
    freed = cache.pop("a").data_ptr()
    put(store, "d", *shape)
    worker.start_load_caches(cache, SharedVolumeMetadata(loads=[spec_for(pins, "d", shape)]))
    assert cache["d"].data_ptr() == freed
    assert torch.equal(cache["b"], want["b"])
    assert torch.equal(cache["c"], want["c"])
    stats = worker.stats.totals.data
    assert stats["loads"] == 4
    assert "load_buffer_fallbacks" not in stats
    # The worker leaves its pins for the scheduler (other ranks may still read them).
    report = worker.build_connector_worker_meta()
    assert report is not None
    assert report.released >= {s.name for s in specs}
    assert len(os.listdir(pins.dir)) == 4


def test_an_exhausted_pool_falls_back_to_fresh_memory(tmp_path: Path) -> None:
    worker, store = make_worker(tmp_path, 2 * MiB)
    shape = (512, 2048)
    a, b = put(store, "a", *shape), put(store, "b", *shape)
    pins = Pins(store)
    first = worker._load(spec_for(pins, "a", shape))
    second = worker._load(spec_for(pins, "b", shape))
    assert torch.equal(first, a)
    assert torch.equal(second, b)
    assert not overlaps(first, second)
    assert worker.stats.totals.data["load_buffer_fallbacks"] == 1


def test_a_corrupt_entry_is_still_a_miss_and_a_failed_load_returns_its_buffer(
    tmp_path: Path,
) -> None:
    from encoderpool_connector.shared_volume.scheduler import SharedVolumeScheduler

    worker, store = make_worker(tmp_path, 8 * MiB)
    shape = (512, 2048)
    put(store, "a", *shape)
    path = store.entry_path(entry_name(FP, "a"))
    with open(path, "r+b") as f:  # flip a payload byte
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    config = worker.config
    sched = SharedVolumeScheduler(
        config,
        store,
        is_producer=False,
        is_consumer=True,
        model_dtype="bfloat16",
        widths=dict(config.encoder_output_widths),
        metadata_resolver=None,
    )
    verdict = sched._verify(entry_name(FP, "a"), Expect("a", FP, "bfloat16", *shape))
    assert not verdict.ok
    assert "checksum" in verdict.reason
    sched.shutdown()
    # An entry that changes after verification fails its load (None: the engine encodes
    # the item instead), and the buffer it was being read into goes back to the pool.
    pins = Pins(store)
    spec = spec_for(pins, "a", shape)
    with open(path, "ab") as f:
        f.write(b"x")
    assert worker._load(spec) is None
    assert worker._buffers is not None
    assert worker._buffers.free_slots == 1


@pytest.mark.parametrize("limit", [0, 64 * MiB])
def test_small_payloads_and_a_disabled_pool_load_into_fresh_tensors(
    tmp_path: Path, limit: int
) -> None:
    worker, store = make_worker(tmp_path, limit)
    shape = (64, 128)
    want = put(store, "s", *shape)
    got = worker._load(spec_for(Pins(store), "s", shape))
    assert torch.equal(got, want)
    assert "load_buffer_fallbacks" not in worker.stats.totals.data


def test_an_entry_out_of_the_page_cache_loads_the_same_bytes(tmp_path: Path) -> None:
    """A load after the page cache dropped the entry (memory pressure) reads the disk."""
    worker, store = make_worker(tmp_path, 64 * MiB)
    shape = (1024, 2048)
    want = put(store, "cold", *shape)
    path = store.entry_path(entry_name(FP, "cold"))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert torch.equal(worker._load(spec_for(Pins(store), "cold", shape)), want)


def test_an_unset_limit_stays_out_of_the_rendered_config(tmp_path: Path) -> None:
    """Operators render configs for connector images of other versions: a key an older
    connector does not know would fail its start (extra keys are forbidden)."""
    worker, _ = make_worker(tmp_path, 4 * MiB)
    rendered = worker.config.to_extra_config()
    assert rendered["shared_volume"]["load_buffer_bytes"] == 4 * MiB
    del rendered["shared_volume"]["load_buffer_bytes"]
    unset = ConnectorConfig.from_extra_config(rendered)
    assert "load_buffer_bytes" not in unset.to_extra_config()["shared_volume"]
    with pytest.raises(ValueError, match="load_buffer_bytes"):
        ConnectorConfig.from_extra_config(
            {**rendered, "shared_volume": {**rendered["shared_volume"], "load_buffer_bytes": -1}}
        )
