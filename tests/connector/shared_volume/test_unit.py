"""Fast tests of the connector's parts without an engine: names, format, store, config."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from encoderpool_connector.contracts import ConnectorConfig
from encoderpool_connector.shared_volume.entry import (
    EntryError,
    EntryMissing,
    Expect,
    Header,
    checksum,
    entry_name,
    is_entry_name,
    verify_file,
)
from encoderpool_connector.shared_volume.store import Pins, SharedStore

FP = "0123456789abcdef"


def header_for(mm_hash: str, payload: bytes, tokens: int = 4, width: int = 8) -> Header:
    assert len(payload) == tokens * width * 2
    return Header(mm_hash, FP, "bfloat16", (tokens, width), checksum(payload))


@pytest.mark.parametrize(
    "mm_hash", ["../../x", "/etc/passwd", "a\x00b", "\udcff", "." * 5000, "", "ok-hash"]
)
def test_any_mm_hash_maps_to_a_plain_name(mm_hash: str) -> None:
    name = entry_name(FP, mm_hash)
    assert is_entry_name(name)
    assert os.path.basename(name) == name
    assert entry_name("fedcba9876543210", mm_hash) != name  # models never share names


def publish(store: SharedStore, mm_hash: str, payload: bytes) -> None:
    result = store.publish(
        entry_name(FP, mm_hash), header_for(mm_hash, payload), memoryview(payload)
    )
    assert result.published or result.reason == "already published", result


def test_publish_then_verify_and_every_kind_of_damage_is_rejected(tmp_path: Path) -> None:
    store = SharedStore(str(tmp_path), 1 << 20, "lru")
    store.prepare_producer()
    payload = os.urandom(64)
    publish(store, "h", payload)
    path = store.entry_path(entry_name(FP, "h"))
    expect = Expect("h", FP, "bfloat16", 4, 8)
    assert verify_file(path, expect).shape == (4, 8)
    with pytest.raises(EntryError, match="tokens"):
        verify_file(path, Expect("h", FP, "bfloat16", 5, 8))
    with pytest.raises(EntryError, match="fingerprint"):
        verify_file(path, Expect("h", "ffffffffffffffff"))
    with pytest.raises(EntryError, match="another item"):
        verify_file(path, Expect("other", FP))
    raw = Path(path).read_bytes()
    Path(path).write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(EntryError, match="checksum"):
        verify_file(path, expect)
    Path(path).write_bytes(raw[:-10])
    with pytest.raises(EntryError, match="truncated"):
        verify_file(path, expect)
    Path(path).write_bytes(b"garbage!" * 100)
    with pytest.raises(EntryError, match="magic"):
        verify_file(path, expect)
    with pytest.raises(EntryMissing):
        verify_file(str(tmp_path / "absent"), expect)


def test_eviction_keeps_the_total_under_capacity_with_concurrent_producers(
    tmp_path: Path,
) -> None:
    capacity = 1 << 20
    stores = [SharedStore(str(tmp_path), capacity, "fifo") for _ in range(4)]
    stores[0].prepare_producer()
    payload = os.urandom(4 * 8 * 2)
    big = os.urandom(32 * 1024 * 2)  # 64 KiB payloads: 16 fit

    def producer(k: int) -> None:
        for i in range(60):
            mm_hash = f"item-{i % 40}"  # producers overlap on the same keys
            data = big[: 32 * 1024 * 2]
            result = stores[k].publish(
                entry_name(FP, mm_hash),
                Header(mm_hash, FP, "bfloat16", (32 * 1024, 1), checksum(data)),
                memoryview(data),
            )
            assert result.published or result.reason == "already published"
            assert stores[k].total_bytes() <= capacity

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stores[0].total_bytes() <= capacity
    assert len(stores[0].scan()) < 40
    assert os.listdir(stores[0].tmp) == []
    for _, _, name in stores[0].scan():
        header = verify_file(stores[0].entry_path(name), Expect(_hash_of(name), FP))
        assert header.payload_bytes == len(big)
    del payload


def _hash_of(name: str) -> str:
    return next(f"item-{i}" for i in range(40) if entry_name(FP, f"item-{i}") == name)


def test_a_pin_survives_eviction_and_a_swept_pin_directory(tmp_path: Path) -> None:
    store = SharedStore(str(tmp_path), 1 << 20, "lru")
    store.prepare_producer()
    payload = os.urandom(64)
    publish(store, "h", payload)
    pins, other = Pins(store), Pins(store)
    pin = pins.pin(entry_name(FP, "h"))
    assert pin is not None
    os.unlink(store.entry_path(entry_name(FP, "h")))  # evicted meanwhile
    assert verify_file(pin, Expect("h", FP)).shape == (4, 8)
    Pins.drop(pin)
    publish(store, "h", payload)
    os.rmdir(pins.dir)  # e.g. removed by another instance's sweep
    assert other.pin(entry_name(FP, "h")) is not None
    assert pins.pin(entry_name(FP, "h")) is not None  # recreated, not a false miss
    assert pins.pin(entry_name(FP, "absent")) is None
    pins.close()
    other.close()


def test_lookups_need_no_layout_and_create_none(tmp_path: Path) -> None:
    store = SharedStore(str(tmp_path / "empty"), 1 << 20, "lru")
    assert not store.exists(entry_name(FP, "x"))
    assert Pins(store).pin(entry_name(FP, "x")) is None
    assert not (tmp_path / "empty").exists()


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({}, "transport"),
        ({"transport": "sharedVolume", "model_fingerprint": FP}, "sharedVolume"),
        (
            {
                "transport": "sharedVolume",
                "model_fingerprint": FP,
                "shared_volume": {"root": "relative", "capacity_bytes": 1 << 30},
            },
            "shared_volume.root",
        ),
        (
            {
                "transport": "sharedVolume",
                "model_fingerprint": FP,
                "shared_volume": {"root": "/c", "capacity_bytes": 10},
            },
            "shared_volume.capacity_bytes",
        ),
        (
            {
                "transport": "sharedVolume",
                "model_fingerprint": FP,
                "shared_volume": {"root": "/c", "capacity_bytes": 1 << 30, "publish_wait_ms": -1},
            },
            "shared_volume.publish_wait_ms",
        ),
    ],
)
def test_bad_config_names_the_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ConnectorConfig.from_extra_config(extra)


def test_an_announcement_of_another_model_is_a_miss_not_a_wait(tmp_path: Path) -> None:
    """A model change rolls producers and consumers apart: a consumer of the old model
    paired with a producer of the new one must not wait for an entry it will never find."""
    from types import SimpleNamespace

    from encoderpool_connector.contracts import Announcement
    from encoderpool_connector.shared_volume.scheduler import SharedVolumeScheduler

    config = ConnectorConfig.from_extra_config(
        {
            "transport": "sharedVolume",
            "model_fingerprint": FP,
            "encoder_output_widths": {"image": 8},
            "shared_volume": {"root": str(tmp_path), "capacity_bytes": 1 << 20},
        }
    )
    sched = SharedVolumeScheduler(
        config,
        SharedStore(str(tmp_path), 1 << 20, "lru"),
        is_producer=False,
        is_consumer=True,
        model_dtype="bfloat16",
        measured_widths={},
        metadata_resolver=None,
    )

    def request(fingerprint: str) -> SimpleNamespace:
        feature = SimpleNamespace(identifier="h1", modality="image")
        params = {"h1": {"encoderpool": Announcement(fingerprint=fingerprint).to_wire()}}
        return SimpleNamespace(
            mm_features=[feature], ec_transfer_params=params, get_num_encoder_embeds=lambda i: 4
        )

    assert sched._start(request(FP), 0).state == "waiting"
    assert sched._start(request("fedcba9876543210"), 0).state == "miss"
    assert sched.stats.data["foreign_announcements"] == 1


def test_a_hostile_writer_s_entries_are_misses_never_hangs_or_huge_buffers(
    tmp_path: Path,
) -> None:
    """Any pod that mounts the volume can write there: a link, a FIFO (an open would
    block), a directory, or a header claiming a huge payload over a sparse file."""
    import time

    from encoderpool_connector.shared_volume.entry import MAX_PAYLOAD, encode_prefix

    store = SharedStore(str(tmp_path), 1 << 20, "lru")
    store.prepare_producer()
    expect = Expect("h", FP)
    path = store.entry_path(entry_name(FP, "h"))
    secret = tmp_path / "outside-the-cache"
    secret.write_bytes(b"not yours")
    os.symlink(secret, path)
    with pytest.raises(EntryError, match="symbolic link"):
        verify_file(path, expect)
    os.unlink(path)
    os.mkfifo(path)
    started = time.monotonic()
    with pytest.raises(EntryError, match="not a regular file"):
        verify_file(path, expect)
    assert time.monotonic() - started < 1  # no writer ever opens the FIFO: no wait
    os.unlink(path)
    os.mkdir(path)
    with pytest.raises(EntryError, match="not a regular file"):
        verify_file(path, expect)
    os.rmdir(path)
    huge = Header("h", FP, "float32", (1 << 20, 1 << 10), checksum(b""))
    prefix = encode_prefix(huge)
    with open(path, "wb") as f:
        f.write(prefix)
        f.truncate(len(prefix) + huge.payload_bytes)  # sparse: the size matches the lie
    assert huge.payload_bytes > MAX_PAYLOAD
    with pytest.raises(EntryError, match="exceeds"):
        verify_file(path, expect)
    assert secret.read_bytes() == b"not yours"
