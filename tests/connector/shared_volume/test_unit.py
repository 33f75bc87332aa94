"""Fast tests of the connector's parts without an engine: names, format, store, config."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from encoderpool_connector.shared_volume.entry import (
    EntryError,
    EntryMissing,
    Expect,
    Header,
    entry_name,
    is_entry_name,
    verify_file,
)
from encoderpool_connector.shared_volume.store import Pins, SharedStore
from encoderpool_contracts import ConnectorConfig
from encoderpool_contracts.integrity import ChannelKey, checksum

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
    assert store.verify(pins.subdir, pin, Expect("h", FP))[0].shape == (4, 8)
    pins.drop(pin)
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

    from encoderpool_connector.shared_volume.scheduler import SharedVolumeScheduler
    from encoderpool_contracts import Announcement

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
        widths=dict(config.encoder_output_widths),
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


# ---- a hostile writer replaces directories ----

OLD = 10_000.0  # seconds: older than every stale-file sweep's bound


def _outside(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A directory outside the cache full of files every sweep or eviction would take:
    an entry-named file (oldest, so first to evict), a stale temp-like file, a pin-like one."""
    outside = tmp_path / "outside"
    outside.mkdir()
    files = {
        entry_name(FP, "sentinel"): b"sentinel entry",
        "stale-temp": b"sentinel temp",
        entry_name(FP, "sentinel") + ".1": b"sentinel pin",
    }
    for name, data in files.items():
        (outside / name).write_bytes(data)
        os.utime(outside / name, (1.0, 1.0))
    return outside, files


def _intact(outside: Path, files: dict[str, bytes]) -> bool:
    return {p.name: p.read_bytes() for p in outside.iterdir()} == files


def _fill(store: SharedStore, n: int, prefix: str = "fill") -> None:
    """Publish ``n`` 64 KiB entries: a 1 MiB store evicts after 15."""
    data = os.urandom(32 * 1024 * 2)
    for i in range(n):
        mm_hash = f"{prefix}-{i}"
        header = Header(mm_hash, FP, "bfloat16", (32 * 1024, 1), checksum(data))
        result = store.publish(entry_name(FP, mm_hash), header, memoryview(data))
        assert result.published, result


@pytest.mark.parametrize("which", ["entries", "tmp", "pins"])
def test_a_directory_found_as_a_link_is_refused_never_followed(
    tmp_path: Path, which: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The link is there before any producer or consumer starts: nothing is created,
    read, written or deleted through it; saves are dropped and lookups miss, warned."""
    outside, files = _outside(tmp_path)
    root = tmp_path / "cache"
    root.mkdir()
    for d in ("entries", "tmp", "pins"):
        if d == which:
            os.symlink(outside, root / d)
        else:
            (root / d).mkdir()
    producer = SharedStore(str(root), 1 << 20, "fifo")
    producer.prepare_producer()  # warns, never raises: the producer serves on
    assert "not usable" in caplog.text
    assert "symbolic link" in caplog.text
    payload = os.urandom(64)
    result = producer.publish(entry_name(FP, "h"), header_for("h", payload), memoryview(payload))
    assert not result.published
    assert "unsafe" in result.reason
    consumer = SharedStore(str(root), 1 << 20, "fifo")
    assert not consumer.exists(entry_name(FP, "sentinel"))
    assert Pins(consumer).pin(entry_name(FP, "sentinel")) is None
    assert consumer.scan() == []
    assert _intact(outside, files)
    assert os.path.islink(root / which)


@pytest.mark.parametrize("which", ["entries", "tmp", "pins"])
def test_a_directory_swapped_after_start_redirects_nothing(tmp_path: Path, which: str) -> None:
    """The writer moves a directory away and puts a link (to a directory of sentinels) in
    its place while producers and consumers run: they keep working on the directories
    they resolved at start, eviction and sweeps delete nothing outside, and a process
    started after the swap misses instead of following the link."""
    outside, files = _outside(tmp_path)
    root = tmp_path / "cache"
    producer = SharedStore(str(root), 1 << 20, "fifo")
    producer.prepare_producer()
    consumer = SharedStore(str(root), 1 << 20, "fifo")
    pins = Pins(consumer)
    payload = os.urandom(64)
    publish(producer, "h", payload)
    assert pins.pin(entry_name(FP, "h")) is not None  # both have resolved their layout
    os.rename(root / which, root / f"{which}.moved")
    os.symlink(outside, root / which)

    _fill(producer, 40)  # evicts ~25 entries and renames 40 temp files
    later = SharedStore(str(root), 1 << 20, "fifo")
    later.prepare_producer()  # sweeps nothing through the link
    pin = pins.pin(entry_name(FP, "fill-39"))
    assert pin is not None
    assert consumer.verify(pins.subdir, pin, Expect("fill-39", FP))[0].shape == (32 * 1024, 1)
    assert producer.total_bytes() <= 1 << 20
    assert _intact(outside, files)
    fresh = SharedStore(str(root), 1 << 20, "fifo")
    assert Pins(fresh).pin(entry_name(FP, "fill-39")) is None  # a miss, never the link
    assert fresh.unsafe
    pins.close()
    assert _intact(outside, files)


def test_a_pin_directory_swapped_for_a_link_or_a_forgery_hands_out_nothing(
    tmp_path: Path,
) -> None:
    """Between verification and load a writer replaces this consumer's pin directory: by
    a link (the worker's read and unlink go nowhere outside) or by a directory holding a
    different file under the pin's name (the worker refuses it: not the verified inode)."""
    outside, files = _outside(tmp_path)
    store = SharedStore(str(tmp_path / "cache"), 1 << 20, "lru")
    store.prepare_producer()
    payload = os.urandom(64)
    publish(store, "h", payload)
    pins = Pins(store)
    pin = pins.pin(entry_name(FP, "h"))
    assert pin is not None
    verified = store.verify(pins.subdir, pin, Expect("h", FP))
    inode, size = verified.inode, verified.offset + verified.header.payload_bytes
    real = Path(pins.dir)
    os.rename(real, real.with_name("moved"))
    os.symlink(outside, real)
    (outside / pin).write_bytes((real.with_name("moved") / pin).read_bytes())
    files[pin] = (outside / pin).read_bytes()
    with pytest.raises(EntryError, match="symbolic link"):
        store.open_verified(pins.subdir, pin, inode, size)
    store.unlink(pins.subdir, pin)  # the worker drops its pin: not through the link
    assert _intact(outside, files)
    os.unlink(real)
    real.mkdir()  # a forged pin: same name, same bytes, another inode
    (real / pin).write_bytes(files[pin])
    with pytest.raises(EntryError, match="not the file that was verified"):
        store.open_verified(pins.subdir, pin, inode, size)
    pins.close()  # empties the directory it made (moved), not the new one
    assert (real / pin).exists()
    assert os.listdir(real.with_name("moved")) == []
    assert _intact(outside, files)


def test_an_entry_that_is_a_link_is_never_pinned_through_and_evicts_as_a_link(
    tmp_path: Path,
) -> None:
    """A link planted under an entry's name, to a valid entry outside the cache: the pin
    is the link itself (refused on open), and eviction removes the link, not its target."""
    outside, _ = _outside(tmp_path)
    store = SharedStore(str(tmp_path / "cache"), 1 << 20, "fifo")
    store.prepare_producer()
    payload = os.urandom(64)
    publish(store, "h", payload)
    name = entry_name(FP, "h")
    valid = outside / "valid-entry"
    os.rename(store.entry_path(name), valid)
    os.symlink(valid, store.entry_path(name))
    os.utime(store.entry_path(name), (1.0, 1.0), follow_symlinks=False)  # evicted first
    pins = Pins(store)
    pin = pins.pin(name)
    assert pin is not None
    with pytest.raises(EntryError, match="symbolic link"):
        store.verify(pins.subdir, pin, Expect("h", FP))
    _fill(store, 16)
    assert not os.path.lexists(store.entry_path(name))
    assert verify_file(str(valid), Expect("h", FP)).shape == (4, 8)
    pins.close()


def test_a_lock_held_forever_or_replaced_drops_the_save_never_hangs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl
    import time

    from encoderpool_connector.shared_volume import store as store_module

    monkeypatch.setattr(store_module, "LOCK_TIMEOUT_S", 0.3)
    store = SharedStore(str(tmp_path), 1 << 20, "lru")
    store.prepare_producer()
    payload = os.urandom(64)
    with open(tmp_path / "lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            publish(store, "h", payload)
        assert time.monotonic() - started < 5
    os.unlink(tmp_path / "lock")
    os.mkfifo(tmp_path / "lock")
    with pytest.raises(OSError, match="not a regular file"):
        publish(store, "h", payload)
    assert os.listdir(tmp_path / "tmp") == []  # the temp file went with the save


# ---- entries signed with the pool's key ----

KEY = ChannelKey(b"unit-test-volume-key-0123456789ab")
OTHER = ChannelKey(b"another-pool-s-volume-key-012345")


def test_with_the_pool_s_key_only_entries_it_signed_are_served(tmp_path: Path) -> None:
    """A pod that mounts the volume but lacks the key cannot plant an entry a keyed
    consumer serves: unsigned, another key's, or a signed header over other bytes."""
    from encoderpool_connector.shared_volume.entry import (
        EntryUnauthenticated,
        encode_prefix,
        parse_prefix,
    )

    signed = SharedStore(str(tmp_path), 1 << 20, "lru", key=KEY)
    signed.prepare_producer()
    payload = os.urandom(64)
    publish(signed, "h", payload)
    name = entry_name(FP, "h")
    path = Path(signed.entry_path(name))
    expect = Expect("h", FP, "bfloat16", 4, 8, key=KEY)
    assert verify_file(str(path), expect).mac  # the honest path
    assert verify_file(str(path), Expect("h", FP)).shape == (4, 8)  # keyless: as before
    honest = path.read_bytes()
    header, offset = parse_prefix(honest)

    forged_payload = os.urandom(64)
    forgeries = {
        "unsigned": encode_prefix(header_for("h", forged_payload)) + forged_payload,
        "another key": encode_prefix(header_for("h", forged_payload).signed(OTHER))
        + forged_payload,
        "old mac over new bytes": encode_prefix(
            Header("h", FP, "bfloat16", (4, 8), checksum(forged_payload), mac=header.mac)
        )
        + forged_payload,
        "signed header, shape changed": encode_prefix(
            Header("h", FP, "bfloat16", (8, 4), header.checksum, mac=header.mac)
        )
        + honest[offset:],
    }
    for what, raw in forgeries.items():
        path.write_bytes(raw)
        with pytest.raises(EntryUnauthenticated, match="mac"):
            verify_file(str(path), expect)
        print(what, "refused")
    path.write_bytes(honest)
    assert verify_file(str(path), expect).shape == (4, 8)


def test_an_entry_of_the_previous_format_is_a_miss(tmp_path: Path) -> None:
    import json
    import struct

    store = SharedStore(str(tmp_path), 1 << 20, "lru")
    store.prepare_producer()
    payload = os.urandom(64)
    publish(store, "h", payload)
    path = Path(store.entry_path(entry_name(FP, "h")))
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<I", raw, 4)
    d = json.loads(raw[8 : 8 + n])
    d["version"] = 1
    old = json.dumps(d, separators=(",", ":")).encode().ljust(n)
    path.write_bytes(raw[:8] + old + raw[8 + n :])
    with pytest.raises(EntryError, match="format version 1"):
        verify_file(str(path), Expect("h", FP))


def test_a_keyed_consumer_counts_unsigned_entries_as_unauthenticated(tmp_path: Path) -> None:
    import time
    from types import SimpleNamespace

    from encoderpool_connector.shared_volume.scheduler import SharedVolumeScheduler

    config = ConnectorConfig.from_extra_config(
        {
            "transport": "sharedVolume",
            "model_fingerprint": FP,
            "encoder_output_widths": {"image": 8},
            "shared_volume": {"root": str(tmp_path), "capacity_bytes": 1 << 20},
        }
    )
    unkeyed = SharedStore(str(tmp_path), 1 << 20, "lru")
    unkeyed.prepare_producer()
    keyed = SharedStore(str(tmp_path), 1 << 20, "lru", key=KEY)
    publish(unkeyed, "planted", os.urandom(64))
    publish(keyed, "honest", os.urandom(64))
    sched = SharedVolumeScheduler(
        config,
        SharedStore(str(tmp_path), 1 << 20, "lru", key=KEY),
        is_producer=False,
        is_consumer=True,
        model_dtype="bfloat16",
        widths=dict(config.encoder_output_widths),
        metadata_resolver=None,
    )

    def decide(mm_hash: str) -> str:
        feature = SimpleNamespace(identifier=mm_hash, modality="image")
        request = SimpleNamespace(
            mm_features=[feature], ec_transfer_params=None, get_num_encoder_embeds=lambda i: 4
        )
        lookup = sched._start(request, 0)
        deadline = time.monotonic() + 10
        while not sched._advance(mm_hash, lookup):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return lookup.state

    assert decide("planted") == "miss"
    assert decide("honest") == "hit"
    assert sched.stats.data["unauthenticated"] == 1
    assert sched.stats.data["rejected"] == 1
    sched.shutdown()


def test_a_moved_pin_directory_is_made_again_and_a_link_in_its_place_is_a_miss(
    tmp_path: Path,
) -> None:
    """The worker finds a pin by name, so a consumer whose pin directory was moved away
    pins into a new one under its name (hits stay loadable); a link put under that name
    makes lookups miss, and nothing is linked into the directory it points to."""
    import shutil

    outside, files = _outside(tmp_path)
    store = SharedStore(str(tmp_path / "cache"), 1 << 20, "lru")
    store.prepare_producer()
    publish(store, "h", os.urandom(64))
    name = entry_name(FP, "h")
    pins = Pins(store)
    assert pins.pin(name) is not None
    os.rename(pins.dir, pins.dir + ".moved")
    pin = pins.pin(name)
    assert pin is not None
    verified = store.verify(pins.subdir, pin, Expect("h", FP))
    size = verified.offset + verified.header.payload_bytes
    os.close(store.open_verified(pins.subdir, pin, verified.inode, size))
    shutil.rmtree(pins.dir)
    os.symlink(outside, pins.dir)
    assert pins.pin(name) is None
    assert "symbolic link" in store.unsafe
    assert _intact(outside, files)
    pins.close()
    assert _intact(outside, files)
