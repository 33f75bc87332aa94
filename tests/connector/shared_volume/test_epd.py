"""The shared-volume connector on the real engine: a producer and a consumer vLLM (tiny
Qwen2-VL) against a monolithic server, through the flow a router runs.

Producer and consumer hold the pool's key (env ``ENCODERPOOL_CHANNEL_KEY``), as the
operator renders them: entries are signed, and forgeries here sign with ``KEY`` when
they play a key holder.

Producer and consumer are shared by the package (``sv_servers``), the monolithic server
by the session; every test uses images no other test uses, because a consumer's
in-memory encoder cache hides entries it has already seen.
"""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from e2e.media import chat_request, encoder_request, image, image_part, token_ids
from e2e.vllm_server import VllmServer
from encoderpool_connector.shared_volume.entry import (
    Header,
    encode_prefix,
    entry_name,
    parse_prefix,
)
from encoderpool_contracts.integrity import ChannelKey, checksum
from tests.connector.fixtures import metric
from tests.connector.shared_volume.fixtures import KEY, SvServers
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm

OTHER_KEY = ChannelKey(b"another-pool-s-volume-key-0123456789")


class Pool:
    """mono + producer + consumer sharing one storage root, plus the router's flow."""

    def __init__(self, mono: VllmServer, producer: VllmServer, consumer: VllmServer, root: Path):
        self.mono, self.producer, self.consumer, self.root = mono, producer, consumer, root
        self.fingerprint = ""

    def encode(self, png: bytes, uuid: str | None = None) -> tuple[str, dict[str, Any]]:
        """What a router does per item: the producer encodes it; returns (mm_hash, params)."""
        out = self.producer.chat(encoder_request(image_part(png, uuid)))
        assert out["usage"]["completion_tokens"] == 0, out
        params = out["ec_transfer_params"]
        ((mm_hash, item),) = params.items()
        assert item["encoderpool"]["fingerprint"] == self.fingerprint
        assert item["metadata"]["image_grid_thw"], item  # placeholder metadata for the consumer
        return mm_hash, params

    def consume(self, png: bytes, params: dict[str, Any] | None, uuid: str | None = None) -> Any:
        body = chat_request(png, uuids=[uuid] if uuid else None)
        if params is not None:
            body["ec_transfer_params"] = params
        return token_ids(self.consumer.chat(body))

    def entry(self, mm_hash: str) -> Path:
        return self.root / "entries" / entry_name(self.fingerprint, mm_hash)

    def published(self, mm_hash: str) -> Path:
        """The item's entry once the producer's background writer has published it (its
        answer comes first: the write is off the request path)."""
        path = self.entry(mm_hash)
        wait_until(f"entry of {mm_hash} published", path.is_file, timeout=30)
        return path


def encoder_ran(server: VllmServer, mm_hash: str) -> bool:
    return f"Finish execute for mm hash {mm_hash}" in server.log_text()


@pytest.fixture(scope="module")
def pool(monolithic: VllmServer, sv_servers: SvServers) -> Pool:
    p = Pool(monolithic, sv_servers.producer, sv_servers.consumer, sv_servers.root)
    p.fingerprint = sv_servers.fingerprint
    return p


def test_consumer_matches_monolithic_without_running_its_encoder(pool: Pool) -> None:
    images = [image(i) for i in range(100, 106)]
    hashes = []
    for png in images:
        expected = token_ids(pool.mono.chat(chat_request(png)))
        mm_hash, params = pool.encode(png)
        hashes.append(mm_hash)
        assert pool.consume(png, params) == expected
    for h in hashes:
        assert pool.entry(h).is_file()
        assert encoder_ran(pool.producer, h)
        assert not encoder_ran(pool.consumer, h), f"consumer encoded {h} itself"
    assert metric(pool.consumer, "encoderpool_ec_hits_total") >= len(images)
    assert metric(pool.consumer, "encoderpool_ec_loads_total") >= len(images)
    assert "fingerprints as" not in pool.consumer.log_text()  # identity agrees with the test bed


def test_consumer_uses_the_entry_not_its_encoder(pool: Pool) -> None:
    """Publish image a's embedding under image b's key: the consumer answers b as if it were a."""
    a, b = image(110), image(111)
    expected_a = token_ids(pool.mono.chat(chat_request(a)))
    assert token_ids(pool.mono.chat(chat_request(b))) != expected_a
    hash_a, _ = pool.encode(a)
    hash_b, params_b = pool.encode(b)
    raw = pool.published(hash_a).read_bytes()
    header, offset = parse_prefix(raw)
    payload = raw[offset:]
    forged = Header(hash_b, header.fingerprint, header.dtype, header.shape, checksum(payload))
    pool.published(hash_b).write_bytes(encode_prefix(forged.signed(KEY)) + payload)
    assert pool.consume(b, params_b) == expected_a


def _corrupt(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x5A  # one payload byte: same size, checksum no longer matches
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])


def _foreign(path: Path) -> None:
    header, offset = parse_prefix(path.read_bytes())
    payload = path.read_bytes()[offset:]
    other = Header(header.mm_hash, "0123456789abcdef", header.dtype, header.shape, header.checksum)
    path.write_bytes(encode_prefix(other.signed(KEY)) + payload)  # a key holder's, other model


@pytest.mark.parametrize(("spoil", "index"), [(_corrupt, 120), (_truncate, 121), (_foreign, 122)])
def test_bad_entry_is_a_miss_and_the_consumer_encodes_itself(
    pool: Pool, spoil: Any, index: int
) -> None:
    png = image(index)
    expected = token_ids(pool.mono.chat(chat_request(png)))
    rejected = metric(pool.consumer, "encoderpool_ec_rejected_total")
    mm_hash, params = pool.encode(png)
    spoil(pool.published(mm_hash))
    assert pool.consume(png, params) == expected
    assert encoder_ran(pool.consumer, mm_hash)
    assert metric(pool.consumer, "encoderpool_ec_rejected_total") == rejected + 1
    assert "rejected entry for item" in pool.consumer.log_text()


def _tree(top: Path) -> set[str]:
    out = set()
    for d, dirs, files in os.walk(top):
        for n in dirs + files:
            out.add(os.path.relpath(os.path.join(d, n), top))
    return out


@pytest.mark.parametrize("uuid", ["../../x", "/etc/passwd", "a/../../../b\x00c", "." * 300])
def test_hostile_uuid_stays_inside_the_root(pool: Pool, uuid: str) -> None:
    base = pool.root.parent.parent  # <tmp>/volume/ec -> <tmp>
    outside = {p for p in _tree(base) if not p.startswith("volume/ec")}
    png = image(130 + len(uuid) % 7)
    expected = token_ids(pool.mono.chat(chat_request(png)))
    mm_hash, params = pool.encode(png, uuid=uuid)
    assert mm_hash == uuid  # the client's uuid really replaced the hash
    assert pool.consume(png, params, uuid=uuid) == expected
    assert {p for p in _tree(base) if not p.startswith("volume/ec")} == outside
    names = os.listdir(pool.root / "entries")
    assert entry_name(pool.fingerprint, uuid) in names
    assert all(re.fullmatch(r"[0-9a-f]{40}\.epc", n) for n in names)
    for server in (pool.producer, pool.consumer):
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            assert r.status == 200


def test_lookups_create_nothing(pool: Pool) -> None:
    """A consumer asked about items nobody published adds no file or directory."""
    before = _tree(pool.root)
    for i in range(140, 143):
        png = image(i)
        assert pool.consume(png, None) == token_ids(pool.mono.chat(chat_request(png)))
    assert _tree(pool.root) == before


def test_pins_are_released_after_loading(pool: Pool) -> None:
    png = image(150)
    expected = token_ids(pool.mono.chat(chat_request(png)))
    mm_hash, params = pool.encode(png)
    assert pool.consume(png, params) == expected
    assert not encoder_ran(pool.consumer, mm_hash)
    pins = pool.root / "pins"
    assert [p for p in _tree(pins) if (pins / p).is_file()] == []


# ---- a hostile writer on the volume ----


def _embedding_of(pool: Pool, png: bytes) -> tuple[Header, bytes]:
    """Another image's published header and payload (what a forger would plant)."""
    mm_hash, _ = pool.encode(png)
    raw = pool.published(mm_hash).read_bytes()
    header, offset = parse_prefix(raw)
    return header, raw[offset:]


def _forged(mm_hash: str, decoy: Header, payload: bytes, key: ChannelKey | None) -> bytes:
    """An entry for ``mm_hash`` holding another image's embedding (signed with ``key``)."""
    header = Header(mm_hash, decoy.fingerprint, decoy.dtype, decoy.shape, checksum(payload))
    return encode_prefix(header.signed(key)) + payload


@pytest.mark.parametrize(("key", "index"), [(None, 160), (OTHER_KEY, 163)])
def test_an_entry_planted_without_the_pool_s_key_is_a_miss(
    pool: Pool, key: ChannelKey | None, index: int
) -> None:
    """Any pod that mounts the volume can write there, but only key holders sign: another
    image's embedding planted under this item's name (valid checksum, no mac or another
    pool's) is refused; the consumer encodes the item itself and answers as the
    monolithic server does. The honest item after it is a hit."""
    png, decoy, honest = image(index), image(index + 1), image(index + 2)
    expected = token_ids(pool.mono.chat(chat_request(png)))
    assert token_ids(pool.mono.chat(chat_request(decoy))) != expected  # a served forgery shows
    unauthenticated = metric(pool.consumer, "encoderpool_ec_unauthenticated_total")
    decoy_header, decoy_payload = _embedding_of(pool, decoy)
    mm_hash, params = pool.encode(png)
    pool.published(mm_hash).write_bytes(_forged(mm_hash, decoy_header, decoy_payload, key))
    assert pool.consume(png, params) == expected
    assert encoder_ran(pool.consumer, mm_hash)
    assert metric(pool.consumer, "encoderpool_ec_unauthenticated_total") == unauthenticated + 1
    assert ("(no mac)" if key is None else "bad mac") in pool.consumer.log_text()

    expected_honest = token_ids(pool.mono.chat(chat_request(honest)))
    honest_hash, honest_params = pool.encode(honest)
    pool.published(honest_hash)
    assert pool.consume(honest, honest_params) == expected_honest
    assert not encoder_ran(pool.consumer, honest_hash)


def test_the_entries_directory_swapped_for_a_link_redirects_nothing(pool: Pool) -> None:
    """While both run, a writer moves ``entries`` away and links it to a directory of its
    own, holding a *validly signed* entry of another image under the next item's name
    (the mac cannot help: only the directory defence can). Producer and consumer keep
    the directory they resolved at start: the item is published there and served from
    there, the answer equals the monolithic server's, and the planted directory is never
    read, written or cleaned."""
    png, decoy = image(170), image(171)
    expected = token_ids(pool.mono.chat(chat_request(png)))
    decoy_hash, decoy_params = pool.encode(decoy)
    raw = pool.published(decoy_hash).read_bytes()
    decoy_header, offset = parse_prefix(raw)
    decoy_payload = raw[offset:]
    # The consumer has resolved its directories (both processes) before the swap.
    decoy_expected = token_ids(pool.mono.chat(chat_request(decoy)))
    assert decoy_expected != expected  # serving the decoy would show in the answer
    assert pool.consume(decoy, decoy_params) == decoy_expected
    outside = pool.root.parent / "planted"
    outside.mkdir()
    entries = pool.root / "entries"
    moved = pool.root / "entries.moved"
    try:
        os.rename(entries, moved)
        os.symlink(outside, entries)
        # The decoy, signed by a key holder, under the name the next item will have (a
        # uuid names the item, so the name is known before the producer publishes).
        mm_hash = "swapped-entries-dir-170"
        planted = {
            entry_name(pool.fingerprint, mm_hash): _forged(
                mm_hash, decoy_header, decoy_payload, KEY
            ),
            "sentinel": b"not the cache's",
        }
        for name, data in planted.items():
            (outside / name).write_bytes(data)
        hits = metric(pool.consumer, "encoderpool_ec_hits_total")
        got_hash, params = pool.encode(png, uuid=mm_hash)
        assert got_hash == mm_hash
        wait_until(
            "published into the directory resolved at start",
            (moved / entry_name(pool.fingerprint, mm_hash)).is_file,
            timeout=30,
        )
        assert pool.consume(png, params, uuid=mm_hash) == expected
        assert not encoder_ran(pool.consumer, mm_hash)
        assert metric(pool.consumer, "encoderpool_ec_hits_total") == hits + 1
        assert {p.name: p.read_bytes() for p in outside.iterdir()} == planted
    finally:
        if entries.is_symlink():
            entries.unlink()
        if moved.exists():
            os.rename(moved, entries)
