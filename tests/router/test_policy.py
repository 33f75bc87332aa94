"""Producer choice (rendezvous hashing with a load bound) and consumer choice."""

from __future__ import annotations

import collections
import hashlib

import pytest

from e2e.media import image, image_part
from encoderpool_router.backends import Backend, BackendSet
from encoderpool_router.content import PartRefused, read_media
from encoderpool_router.media import media_key
from encoderpool_router.policy import (
    RecentlyEncoded,
    choose_consumer,
    choose_producer,
    hrw_rank,
)
from encoderpool_router.producer_request import encoder_request

KEYS = [hashlib.sha256(str(i).encode()).digest()[:16] for i in range(4000)]


def backends(n: int) -> list[Backend]:
    return [Backend(f"http://127.0.0.1:{8000 + i}") for i in range(n)]


def owners(keys: list[bytes], pool: list[Backend]) -> dict[bytes, str]:
    out = {}
    for k in keys:
        chosen = choose_producer(k, pool, load_bound=1)
        assert chosen is not None
        out[k] = chosen.url
    return out


def test_the_same_media_goes_to_the_same_producer_and_keys_spread_evenly() -> None:
    pool = backends(4)
    first, again = owners(KEYS, pool), owners(KEYS, list(reversed(pool)))
    assert first == again  # order of discovery does not matter
    shares = collections.Counter(first.values())
    assert set(shares) == {b.url for b in pool}
    assert all(800 <= n <= 1200 for n in shares.values()), shares  # 1000 each on average


def test_a_producer_leaving_moves_only_its_own_items() -> None:
    pool = backends(4)
    before = owners(KEYS, pool)
    gone = pool[2]
    after = owners(KEYS, [b for b in pool if b is not gone])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved == [k for k in KEYS if before[k] == gone.url]
    # And joining again brings back exactly the old assignment.
    assert owners(KEYS, pool) == before


def test_a_busy_preferred_producer_yields_to_the_next_in_the_items_ranking() -> None:
    pool = backends(3)
    key = KEYS[0]
    ranked = hrw_rank(key, pool)
    assert choose_producer(key, pool, load_bound=2) is ranked[0]
    ranked[0].in_flight = 2
    assert choose_producer(key, pool, load_bound=2) is ranked[1]
    ranked[1].in_flight = 5
    assert choose_producer(key, pool, load_bound=2) is ranked[2]
    ranked[2].in_flight = 3
    # Everyone is past the bound: the least busy.
    assert choose_producer(key, pool, load_bound=2) is ranked[0]


def test_ejected_backends_are_skipped_until_all_are() -> None:
    pool = backends(2)
    key = KEYS[1]
    first = hrw_rank(key, pool)[0]
    first.ejected_until = float("inf")
    assert choose_producer(key, pool, load_bound=4) is not first
    for b in pool:
        b.ejected_until = float("inf")
    assert choose_producer(key, pool, load_bound=4) is first  # better than nothing
    assert choose_producer(key, [], load_bound=4) is None


def test_consumers_least_busy_first_and_retries_go_elsewhere() -> None:
    pool = backends(3)
    pool[0].in_flight, pool[1].in_flight, pool[2].in_flight = 3, 1, 2
    assert choose_consumer(pool) is pool[1]
    assert choose_consumer(pool, exclude=[pool[1]]) is pool[2]
    assert choose_consumer(pool[:1], exclude=pool[:1]) is pool[0]  # nothing else left
    assert choose_consumer([]) is None
    idle = backends(3)
    picks = collections.Counter(choose_consumer(idle) for _ in range(300))
    assert set(picks) == set(idle)  # ties are broken at random, so idle consumers share


def test_backend_sets_keep_counters_across_updates() -> None:
    changes: list[list[str]] = []
    s = BackendSet("producer", ["http://a:1", "http://b:1"])
    s.listeners.append(lambda bs: changes.append(bs.urls))
    s.backends[0].in_flight = 3
    s.replace(["http://b:1", "http://a:1"])  # same set: no change
    s.replace(["http://a:1", "http://c:1"])
    assert [b.url for b in s.backends] == ["http://a:1", "http://c:1"]
    assert s.backends[0].in_flight == 3
    assert changes == [["http://a:1", "http://c:1"]]


def test_media_items_keys_and_encoder_requests() -> None:
    a, b = image_part(image(1)), image_part(image(2), uuid="item-b")
    audio = {"data": "AAA", "format": "wav"}
    body = {
        "model": "m",
        "mm_processor_kwargs": {"max_pixels": 12544},
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [a, {"type": "text", "text": "and"}, b]},
            {"role": "user", "content": [{"type": "input_audio", "input_audio": audio}]},
        ],
    }
    items = read_media(body, trust_ids=True).parts
    assert [p["type"] for p in items] == ["image_url", "image_url", "input_audio"]
    with pytest.raises(PartRefused):
        read_media({"messages": "nope"}, trust_ids=True)
    assert media_key(a) == media_key(image_part(image(1)))
    assert media_key(a) != media_key(image_part(image(3)))
    assert media_key(b) == media_key(image_part(image(9), uuid="item-b"))  # the uuid names it
    assert encoder_request(body, b) == {
        "model": "m",
        "mm_processor_kwargs": {"max_pixels": 12544},
        "messages": [{"role": "user", "content": [b]}],
        "max_tokens": 1,
        "stream": False,
    }


def test_recently_encoded_expires_and_is_bounded() -> None:
    recent = RecentlyEncoded(ttl_s=10, capacity=2)
    recent.add(b"a", now=0)
    assert recent.fresh(b"a", now=9.9)
    assert not recent.fresh(b"a", now=10)
    assert not recent.fresh(b"a", now=1)  # expired entries are gone for good
    for k in (b"x", b"y", b"z"):
        recent.add(k, now=0)
    assert [recent.fresh(k, now=1) for k in (b"x", b"y", b"z")] == [False, True, True]
