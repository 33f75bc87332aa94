"""Fast tests of the RDMA connector's parts without an engine or NIXL: the allocator, slot
headers, the shared region, coordinates, release notices and the side channel (hostile input).
"""

from __future__ import annotations

import base64
import errno
import json
import os
import random
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from encoderpool_connector.rdma.auth import META_REPLY, META_REQUEST, NonceBook
from encoderpool_connector.rdma.buffer import (
    ALIGN,
    HEADER_BYTES,
    SharedRegion,
    SlotAllocator,
    SlotHeader,
    is_region_path,
    key_digest,
    sweep_dead_regions,
    unpack_slot_header,
)
from encoderpool_connector.rdma.channel import (
    MAX_CONNECTIONS,
    SideChannelServer,
    WireError,
    encode_frame,
    encode_release,
    fetch_peer,
    meta_request,
    parse_coordinates,
    parse_meta_reply,
    parse_release,
    read_frame,
    valid_host,
)
from encoderpool_contracts import ConnectorConfig
from encoderpool_contracts.integrity import AuthError, ChannelKey
from tests.connector.rdma.slow_loris import slow_loris

FP = "0123456789abcdef"

# ---- allocator ----


def test_allocator_first_fit_alignment_and_reuse() -> None:
    a = SlotAllocator(1024)
    s1, ev = a.allocate("a", 100, now=1)
    s2, _ = a.allocate("b", 1, now=2)
    assert s1 is not None
    assert s2 is not None
    assert not ev
    assert (s1.offset, s1.size) == (0, 128)
    assert (s2.offset, s2.size) == (128, ALIGN)
    assert s2.generation > s1.generation
    a.free(s1.offset)
    s3, _ = a.allocate("c", 64, now=3)
    assert s3 is not None
    assert s3.offset == 0  # the gap is reused
    assert a.used == 128
    assert len(a) == 2


def test_allocator_evicts_oldest_unlocked_and_never_locked() -> None:
    a = SlotAllocator(4 * 256)
    slots = []
    for i in range(4):
        s, _ = a.allocate(f"k{i}", 256, now=i)
        assert s is not None
        slots.append(s)
    slots[0].locked = True  # being written or read: never evicted
    for s in slots[1:]:
        s.locked = False
    slots[1].refs = 1  # announced, unconfirmed: goes after confirmed ones
    new, evicted = a.allocate("new", 256, now=10)
    assert new is not None
    assert [s.key for s in evicted] == ["k2"]
    assert new.offset == slots[2].offset
    assert a.evicted == 1
    assert a.evicted_bytes == 256
    # Everything left locked or too big: no room, nothing evicted wrongly.
    for s in a.slots():
        s.locked = True
    none, evicted = a.allocate("x", 256, now=11)
    assert none is None
    assert evicted == []
    assert a.allocate("huge", 1 << 20)[0] is None


def test_allocator_evicts_until_a_contiguous_gap_fits() -> None:
    a = SlotAllocator(4 * 64)
    made = [a.allocate(f"k{i}", 64, now=i)[0] for i in range(4)]
    for s in made:
        assert s is not None
        s.locked = False
    big, evicted = a.allocate("big", 3 * 64, now=9)
    assert big is not None
    assert [s.key for s in evicted] == ["k0", "k1", "k2"]
    assert a.allocate("no-evict", 64, evict=False)[0] is None


def test_allocator_expire_and_free_unknown() -> None:
    a = SlotAllocator(1024)
    a.allocate("old", 64, now=1)
    a.allocate("new", 64, now=100)
    assert [s.key for s in a.expire(50)] == ["old"]
    assert a.free(12345) is None
    assert [s.key for s in a.slots()] == ["new"]
    with pytest.raises(ValueError, match="capacity"):
        SlotAllocator(10)


def test_allocator_random_workload_keeps_slots_disjoint() -> None:
    rng = random.Random(7)  # noqa: S311  # a reproducible workload
    a = SlotAllocator(1 << 16)
    for step in range(2000):
        if rng.random() < 0.6:
            s, _ = a.allocate(str(step), rng.randint(1, 9000), now=step)
            if s is not None:
                s.locked = rng.random() < 0.2
        elif len(a):
            a.free(rng.choice(a.slots()).offset)
        spans = sorted((s.offset, s.offset + s.size) for s in a.slots())
        assert all(e <= a.capacity for _, e in spans)
        assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))


# ---- slot headers ----


def test_slot_header_round_trip_and_rejects_damage() -> None:
    h = SlotHeader(7, 4 * 8 * 2, "bfloat16", (4, 8), key_digest("h"), b"\x01" * 32)
    raw = h.pack()
    assert len(raw) <= HEADER_BYTES
    assert unpack_slot_header(raw) == h
    assert unpack_slot_header(raw[:10]) is None
    assert unpack_slot_header(b"\0" * HEADER_BYTES) is None  # empty / invalidated slot
    bad_size = bytearray(raw)
    struct.pack_into("<Q", bad_size, 16, 999)
    assert unpack_slot_header(bytes(bad_size)) is None
    bad_dtype = bytearray(raw)
    bad_dtype[24] = 99
    assert unpack_slot_header(bytes(bad_dtype)) is None
    assert key_digest("a") != key_digest("b")
    assert len(key_digest("\udcff" * 1000)) == 32


# ---- shared region ----


def test_shared_region_is_shared_and_removed(tmp_path: Path) -> None:
    r = SharedRegion.create(str(tmp_path), 1 << 20)
    assert is_region_path(r.path, str(tmp_path))
    assert not is_region_path(r.path, "/elsewhere")
    assert not is_region_path(str(tmp_path / "../etc/passwd"), str(tmp_path))
    r.view[10:15] = b"hello"
    other = SharedRegion(r.path, 1 << 20, create=False, writable=False)
    assert bytes(other.view[10:15]) == b"hello"
    assert r.address != 0
    with pytest.raises(AssertionError, match="writable"):
        _ = other.address
    with pytest.raises(ValueError, match="expected"):
        SharedRegion(r.path, 2 << 20, create=False)
    other.close()
    r.close()
    assert not os.path.exists(r.path)


def test_sweep_removes_regions_of_dead_processes_only(tmp_path: Path) -> None:
    dead = tmp_path / "encoderpool-rdma-999999999-deadbeef"
    dead.write_bytes(b"x")
    mine = tmp_path / f"encoderpool-rdma-{os.getpid()}-00000000"
    mine.write_bytes(b"x")
    other = tmp_path / "unrelated"
    other.write_bytes(b"x")
    assert sweep_dead_regions(str(tmp_path)) == 1
    assert not dead.exists()
    assert mine.exists()
    assert other.exists()
    assert sweep_dead_regions(str(tmp_path / "missing")) == 0


# ---- coordinates ----


def coords(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "v": 1,
        "agent": "ep-p-1-abc",
        "host": "10.0.0.7",
        "port": 5600,
        "offset": 256,
        "size": 16 * 128 * 2,
        "dtype": "bfloat16",
        "shape": [16, 128],
        "checksum": "blake3:" + "ab" * 32,
        "gen": 3,
    }
    base.update(over)
    return base


def test_valid_coordinates_round_trip() -> None:
    c = parse_coordinates(coords())
    assert c.shape == (16, 128)
    assert parse_coordinates(c.to_json()) == c
    assert parse_coordinates(coords(host="producer-0.pool.ns.svc")).host.endswith("svc")
    assert parse_coordinates(coords(host="fe80::1")).host == "fe80::1"


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"v": 2}, "version"),
        ({"host": "evil host"}, "host"),
        ({"host": "http://x/"}, "host"),
        ({"host": ""}, "host"),
        ({"host": 7}, "host"),
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"port": "5600"}, "port"),
        ({"port": True}, "port"),
        ({"offset": -1}, "offset"),
        ({"offset": 1.5}, "offset"),
        ({"size": 1 << 40, "shape": [1 << 19, 1 << 20]}, "size"),
        ({"size": 12}, "does not match"),
        ({"dtype": "int8"}, "dtype"),
        ({"shape": []}, "shape"),
        ({"shape": [16, -128]}, "shape"),
        ({"shape": "16x128"}, "shape"),
        ({"shape": [1] * 9}, "shape"),
        ({"agent": "x" * 500}, "agent"),
        ({"agent": "a/b"}, "agent"),
        ({"checksum": "md5:00"}, "checksum"),
        ({"gen": 0}, "gen"),
    ],
)
def test_hostile_coordinates_are_rejected(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(WireError, match=match):
        parse_coordinates(coords(**bad))


@pytest.mark.parametrize("garbage", [None, [], "x", 5, {"v": 1}, {}])
def test_garbage_coordinates_are_rejected(garbage: Any) -> None:
    with pytest.raises(WireError):
        parse_coordinates(garbage)


def test_valid_host() -> None:
    assert valid_host("127.0.0.1")
    assert valid_host("a-b.c")
    for bad in ("", "a b", "a:80", "-x", "x" * 300, "a/b", "a\nb"):
        assert not valid_host(bad), bad


# ---- release notices ----


def test_release_notices() -> None:
    assert parse_release(encode_release(512, 9, None), None) == (512, 9)
    for raw in (b"", b"\xff\xfe", b"[]", b'{"v":1}', b'{"v":2,"slot":1,"gen":1}', b"x" * 1000):
        with pytest.raises(WireError):
            parse_release(raw, None)


# ---- side channel ----


def meta_reply(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "agent": "ep-p-1-abc",
        "metadata": base64.b64encode(b"nixl-bytes").decode(),
        "base": 1 << 40,
        "length": 1 << 20,
        "fingerprint": FP,
    }
    body.update(over)
    return body


@pytest.fixture
def server() -> Any:
    s = SideChannelServer("127.0.0.1", 0, meta_reply(), timeout=0.5, key=None)
    yield s
    s.close()


def test_side_channel_serves_metadata(server: SideChannelServer) -> None:
    info = fetch_peer("127.0.0.1", server.port, 2.0, None)
    assert info.metadata == b"nixl-bytes"
    assert info.agent == "ep-p-1-abc"
    assert info.fingerprint == FP


def _raw_exchange(port: int, payload: bytes) -> bytes:
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as s:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(4096):
                out += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass  # the server closed with our garbage unread: a reset, not a reply
        except OSError as e:  # or closed before our shutdown: not connected, not a reply
            if e.errno != errno.ENOTCONN:
                raise
    return out


GARBAGE = [
    random.Random(seed).randbytes(n)  # noqa: S311  # reproducible junk
    for seed, n in ((1, 64), (2, 3), (3, 4096), (4, 9))
]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"GET / HTTP/1.1\r\n\r\n",
        struct.pack(">I", 1 << 30),
        struct.pack(">I", 0),
        struct.pack(">I", 10) + b"not json!!",
        encode_frame({"v": 9, "op": "meta"}),
        encode_frame({"v": 1, "op": "drop_tables"}),
        struct.pack(">I", 100) + b"{}",  # truncated
        *GARBAGE,
    ],
    ids=lambda p: f"{len(p)}B-{p[:6].hex()}",
)
def test_side_channel_refuses_garbage_and_keeps_serving(
    server: SideChannelServer, payload: bytes
) -> None:
    out = _raw_exchange(server.port, payload)
    # A refusal, or nothing: a reset (our garbage left unread) may swallow the refusal.
    if len(out) >= 4 and len(out) >= 4 + struct.unpack(">I", out[:4])[0]:
        reply = json.loads(out[4:])
        assert reply["ok"] is False
        assert reply["error"]
    deadline = time.monotonic() + 2
    while server.refused < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the refusal is counted on the server's thread
    assert server.refused >= 1
    assert fetch_peer("127.0.0.1", server.port, 2.0, None).agent == "ep-p-1-abc"


def test_side_channel_survives_a_flood_of_idle_connections(server: SideChannelServer) -> None:
    idle = [
        socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS * 2)
    ]
    try:
        # Idle clients time out (0.5 s) or are refused at once; a real one gets through.
        deadline = threading.Event()
        got = None
        for _ in range(20):
            try:
                got = fetch_peer("127.0.0.1", server.port, 2.0, None)
                break
            except (OSError, WireError):
                deadline.wait(0.2)
        assert got is not None
    finally:
        for s in idle:
            s.close()


def test_side_channel_port_in_use_names_the_key() -> None:
    first = SideChannelServer("127.0.0.1", 0, meta_reply(), timeout=0.5, key=None)
    try:
        with pytest.raises(OSError, match="side_channel_port"):
            SideChannelServer("127.0.0.1", first.port, meta_reply(), timeout=0.5, key=None)
    finally:
        first.close()


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        ({"v": 1, "ok": False, "error": "nope"}, "refused"),
        ({"v": 2, "ok": True}, "version"),
        ({"v": 1, "ok": True, **meta_reply(metadata="%%%")}, "base64"),
        ({"v": 1, "ok": True, **meta_reply(metadata="")}, "metadata"),
        ({"v": 1, "ok": True, **meta_reply(base=0)}, "base"),
        ({"v": 1, "ok": True, **meta_reply(length=-5)}, "length"),
        ({"v": 1, "ok": True, **meta_reply(fingerprint="xyz")}, "fingerprint"),
        ({"v": 1, "ok": True, **meta_reply(agent="a b")}, "agent"),
        ([1, 2], "object"),
    ],
)
def test_hostile_side_channel_replies_are_rejected(reply: Any, match: str) -> None:
    with pytest.raises(WireError, match=match):
        parse_meta_reply(reply)


def test_fetch_from_a_closed_port_is_an_oserror() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ConnectionRefusedError):
        fetch_peer("127.0.0.1", port, 0.5, None)


# ---- config ----


def test_rdma_settings_parse_and_name_bad_keys() -> None:
    cfg = ConnectorConfig.from_extra_config(
        {
            "transport": "rdma",
            "model_fingerprint": FP,
            "rdma": {"buffer_bytes": 64 << 20, "transfer_timeout_ms": 2000},
        }
    )
    assert cfg.rdma is not None
    assert cfg.rdma.bind_host == "0.0.0.0"  # noqa: S104
    assert cfg.rdma.shm_dir == "/dev/shm"
    with pytest.raises(ValueError, match=r"rdma\.transfer_timeout_ms"):
        ConnectorConfig.from_extra_config(
            {"transport": "rdma", "model_fingerprint": FP, "rdma": {"transfer_timeout_ms": 1}}
        )
    with pytest.raises(ValueError, match=r"rdma\.bind_host"):
        ConnectorConfig.from_extra_config(
            {"transport": "rdma", "model_fingerprint": FP, "rdma": {"bind_host": "a b"}}
        )


# ---- the channel key: an authenticated side channel ----

KEY = ChannelKey(b"unit-test-channel-key-0123456789")
OTHER = ChannelKey(b"another-pool-s-key-0123456789ab")


def test_channel_key_signs_per_label_and_refuses_anything_else() -> None:
    body = {"v": 1, "op": "meta", "ts": 1.5, "nonce": "ab" * 16}
    signed = KEY.sign(META_REQUEST, body)
    assert KEY.check(META_REQUEST, signed) == body
    for bad, why in [
        (body, "unsigned"),
        (OTHER.sign(META_REQUEST, body), "bad mac"),
        (KEY.sign(META_REPLY, body), "bad mac"),  # another kind of message
        ({**signed, "ts": 2.5}, "bad mac"),  # changed after signing
        ({**signed, "mac": "zz"}, "malformed"),
        ([1], "object"),
    ]:
        with pytest.raises(AuthError, match=why):
            KEY.check(META_REQUEST, bad)
    with pytest.raises(ValueError, match="ENCODERPOOL_CHANNEL_KEY"):
        ChannelKey(b"short")
    assert ChannelKey.from_env({}) is None
    assert ChannelKey.from_env({"ENCODERPOOL_CHANNEL_KEY": "  "}) is None
    assert "hidden" in repr(ChannelKey.from_env({"ENCODERPOOL_CHANNEL_KEY": "x" * 32}))


def test_signed_release_notices() -> None:
    assert parse_release(encode_release(512, 9, KEY), KEY) == (512, 9)
    for raw in (encode_release(512, 9, None), encode_release(512, 9, OTHER)):
        with pytest.raises(AuthError):
            parse_release(raw, KEY)


def test_nonce_book_refuses_replays_and_stays_bounded() -> None:
    book = NonceBook(window=10.0, capacity=3)
    book.add("a", 0.0)
    with pytest.raises(AuthError, match="replayed"):
        book.add("a", 1.0)
    book.add("b", 1.0)
    book.add("c", 2.0)
    with pytest.raises(AuthError, match="too many"):
        book.add("d", 3.0)  # full of live nonces: refuse rather than forget one
    book.add("d", 10.5)  # "a" aged out


@pytest.fixture
def keyed() -> Any:
    s = SideChannelServer("127.0.0.1", 0, meta_reply(), timeout=0.5, key=KEY)
    yield s
    s.close()


def _ask(port: int, request: Any, source: str = "127.0.0.1") -> Any:
    with socket.create_connection(("127.0.0.1", port), timeout=3, source_address=(source, 0)) as s:
        s.sendall(encode_frame(request))
        return read_frame(s, 1 << 20, time.monotonic() + 3)


def test_keyed_side_channel_refuses_unsigned_forged_stale_and_replayed_requests(
    keyed: SideChannelServer,
) -> None:
    now = time.time()
    honest, nonce = meta_request(KEY, now)
    reply = _ask(keyed.port, honest)
    assert KEY.check(META_REPLY, reply)["nonce"] == nonce  # served, signed for this request
    stale, _ = meta_request(KEY, now - 120)
    ahead, _ = meta_request(KEY, now + 120)
    for request in (
        {"v": 1, "op": "meta"},  # unsigned
        meta_request(OTHER, now)[0],  # another pool's key
        {**meta_request(KEY, now)[0], "op": "drop"},  # changed after signing
        honest,  # replayed
        stale,
        ahead,
    ):
        out = _ask(keyed.port, request)
        assert out == {"v": 1, "ok": False, "error": "unauthenticated"}, request
        assert "metadata" not in out
    assert keyed.take_counts()["unauthenticated"] == 6  # counted before the refusal is sent
    assert fetch_peer("127.0.0.1", keyed.port, 2.0, KEY).agent == "ep-p-1-abc"


def test_fetch_refuses_replies_of_another_key_or_request_and_unsigned_ones() -> None:
    unsigned = SideChannelServer("127.0.0.1", 0, meta_reply(), timeout=0.5, key=None)
    other = SideChannelServer("127.0.0.1", 0, meta_reply(), timeout=0.5, key=OTHER)
    try:
        with pytest.raises(AuthError, match="unsigned"):
            fetch_peer("127.0.0.1", unsigned.port, 2.0, KEY)
        with pytest.raises(WireError, match="refused"):  # it refuses our request
            fetch_peer("127.0.0.1", other.port, 2.0, KEY)
    finally:
        unsigned.close()
        other.close()
    # A relay answering with a genuine reply to an earlier request: refused.
    recorded = KEY.sign(META_REPLY, {"v": 1, "ok": True, **meta_reply(), "nonce": "cd" * 16})
    relay = _OneReply(encode_frame(recorded))
    try:
        with pytest.raises(AuthError, match="another request"):
            fetch_peer("127.0.0.1", relay.port, 2.0, KEY)
    finally:
        relay.close()


class _OneReply:
    """A fake producer: reads whatever comes, answers ``payload`` a chunk every ``every`` s."""

    def __init__(self, payload: bytes, chunk: int = 1 << 20, every: float = 0.0) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.payload, self.chunk, self.every = payload, chunk, every
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.recv(4096)
            try:
                for i in range(0, len(self.payload), self.chunk):
                    conn.sendall(self.payload[i : i + self.chunk])
                    time.sleep(self.every)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def test_a_dribbling_producer_is_cut_at_the_fetch_deadline() -> None:
    reply = encode_frame(KEY.sign(META_REPLY, {"v": 1, "ok": True, **meta_reply()}))
    slow = _OneReply(reply, chunk=1, every=0.1)  # a byte every 0.1 s: never idle 0.5 s
    try:
        t0 = time.monotonic()
        with pytest.raises(WireError, match="deadline"):
            fetch_peer("127.0.0.1", slow.port, 0.5, KEY)
        assert time.monotonic() - t0 < 1.0
    finally:
        slow.close()


def test_slow_loris_is_cut_at_the_deadline_and_capped_per_peer(keyed: SideChannelServer) -> None:
    """From 127.0.0.2, ten connections sending a byte every 0.1 s: four are held until the
    0.5 s deadline (not one byte later), six are closed at once; 127.0.0.1 is served."""

    def honest_fetch(elapsed: float) -> None:
        if 0.2 < elapsed < 0.35:  # while the four are held
            assert fetch_peer("127.0.0.1", keyed.port, 2.0, KEY).agent == "ep-p-1-abc"

    times = slow_loris(keyed.port, 3, honest_fetch)
    assert len(times) == 10, times
    # Seen a round (0.1 s) late at worst, and later on a loaded machine: what tells the two
    # groups apart is that the six are closed before the four's deadline, the four at it.
    early, held = times[:6], times[6:]
    assert max(early) < 0.45, times  # over the per-peer cap: at once
    assert held[0] - early[-1] > 0.1, times
    assert all(0.45 < t < 1.5 for t in held), times  # the capped four: at the deadline
