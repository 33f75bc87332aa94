"""Consumer choice by media affinity (``--consumer-policy media-affinity``).

Unit tests of ``choose_consumer_by_media``, then the router end to end against the
in-process fakes: repeats of an image meet one consumer, distinct images spread, a
busy or failing consumer yields to the next in the image's ranking, text-only
requests and the default policy go to the least busy, and nothing a client sends
besides the media itself moves its request.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any

import aiohttp
import pytest

from e2e.media import chat_request, image, image_part, media_parts
from encoderpool_router.app import Router
from encoderpool_router.backends import Backend
from encoderpool_router.config import parse_settings
from encoderpool_router.media import media_key
from encoderpool_router.policy import choose_consumer_by_media, hrw_rank
from tests.router.fixtures import FakeBackend, fakes, router_at, run

KEYS = [hashlib.sha256(str(i).encode()).digest()[:16] for i in range(4000)]
AFFINE = {"consumer_policy": "media-affinity"}
CHAT = "/v1/chat/completions"


def backends(n: int) -> list[Backend]:
    return [Backend(f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def chosen(key: bytes | None, pool: list[Backend], bound: int = 4, **kw: Any) -> Backend:
    consumer, _ = choose_consumer_by_media(key, pool, bound, **kw)
    assert consumer is not None
    return consumer


# --- the policy ------------------------------------------------------------------------------


def test_a_key_has_one_consumer_and_keys_spread_evenly() -> None:
    pool = backends(4)
    first = {k: chosen(k, pool).url for k in KEYS}
    assert first == {k: chosen(k, list(reversed(pool))).url for k in KEYS}  # order-free
    shares = collections.Counter(first.values())
    assert set(shares) == {b.url for b in pool}
    assert all(800 <= n <= 1200 for n in shares.values()), shares  # 1000 each on average
    # A consumer leaving moves only its own keys; the others keep their caches.
    gone = pool[1]
    after = {k: chosen(k, [b for b in pool if b is not gone]).url for k in KEYS}
    assert [k for k in KEYS if first[k] != after[k]] == [k for k in KEYS if first[k] == gone.url]


def test_the_bound_passes_a_busy_consumer_down_the_keys_ranking() -> None:
    pool = backends(3)
    key = KEYS[0]
    ranked = hrw_rank(key, pool)
    assert choose_consumer_by_media(key, pool, 2) == (ranked[0], "affinity")
    ranked[0].in_flight = 2  # at the bound
    assert choose_consumer_by_media(key, pool, 2) == (ranked[1], "next_ranked")
    ranked[1].in_flight = 7
    assert choose_consumer_by_media(key, pool, 2) == (ranked[2], "next_ranked")
    ranked[2].in_flight = 2
    # All at the bound: the least busy; among equals the earliest in the ranking.
    assert choose_consumer_by_media(key, pool, 2) == (ranked[0], "over_bound")
    ranked[2].in_flight = 1
    assert choose_consumer_by_media(key, pool, 2) == (ranked[2], "next_ranked")


def test_tried_and_ejected_consumers_are_skipped_until_nothing_else_is_left() -> None:
    pool = backends(3)
    key = KEYS[1]
    ranked = hrw_rank(key, pool)
    assert choose_consumer_by_media(key, pool, 4, exclude=[ranked[0]]) == (
        ranked[1],
        "next_ranked",
    )
    ranked[1].ejected_until = float("inf")
    assert chosen(key, pool, exclude=[ranked[0]]) is ranked[2]
    assert chosen(key, pool, exclude=ranked) is ranked[0]  # all tried: the ranking again
    for b in pool:
        b.ejected_until = float("inf")
    assert chosen(key, pool) is ranked[0]  # all ejected: better than nothing
    assert choose_consumer_by_media(key, [], 4) == (None, "over_bound")


def test_no_media_key_means_least_busy() -> None:
    pool = backends(3)
    pool[0].in_flight, pool[1].in_flight, pool[2].in_flight = 3, 1, 2
    assert choose_consumer_by_media(None, pool, 4) == (pool[1], "no_media")
    assert chosen(None, pool, exclude=[pool[1]]) is pool[2]


# --- settings --------------------------------------------------------------------------------


def test_the_policy_is_a_flag_and_a_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["--consumers", "http://127.0.0.1:1"]
    default = parse_settings(base)
    assert (default.consumer_policy, default.consumer_load_bound) == ("least-busy", 16)
    s = parse_settings([*base, "--consumer-policy", "media-affinity", "--consumer-load-bound", "3"])
    assert (s.consumer_policy, s.consumer_load_bound) == ("media-affinity", 3)
    monkeypatch.setenv("ENCODERPOOL_ROUTER_CONSUMER_POLICY", "media-affinity")
    assert parse_settings(base).consumer_policy == "media-affinity"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--consumer-policy", "round-robin"],
         "--consumer-policy (ENCODERPOOL_ROUTER_CONSUMER_POLICY): Input should be 'least-busy' "
         "or 'media-affinity'"),
        (["--consumer-load-bound", "0"],
         "--consumer-load-bound (ENCODERPOOL_ROUTER_CONSUMER_LOAD_BOUND): Input should be "
         "greater than or equal to 1"),
    ],
)  # fmt: skip
def test_bad_policy_values_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match="invalid router settings") as e:
        parse_settings(["--consumers", "http://127.0.0.1:1", *argv])
    assert message in str(e.value)


# --- the router end to end -------------------------------------------------------------------


async def served_by(url: str, body: dict[str, Any], path: str = CHAT) -> str:
    """Which fake consumer answered ``body``."""
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    return str(out["served_by"])


def choices(router: Router) -> dict[str, float]:
    """encoderpool_router_consumer_choices_total by choice, zeros left out."""
    out = {}
    for metric in router.metrics.consumer_choices.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and sample.value:
                out[sample.labels["choice"]] = sample.value
    return out


def home(router: Router, body: dict[str, Any]) -> Backend:
    """The consumer first in the ranking of ``body``'s first media item."""
    return hrw_rank(media_key(media_parts(body)[0]), router.consumers.backends)[0]


def consumers(n: int) -> list[FakeBackend]:
    return [FakeBackend(f"consumer-{i}") for i in range(n)]


def names(urls: list[str], cs: list[FakeBackend]) -> dict[str, str]:
    """Each fake's name by its URL (the router knows backends by URL)."""
    return {u: c.name for u, c in zip(urls, cs, strict=True)}


def test_repeats_of_an_image_meet_one_consumer_and_images_spread() -> None:
    async def scenario() -> None:
        cs = consumers(3)
        async with fakes(*cs) as urls, router_at([], urls, **AFFINE) as (router, url):
            by_url = names(urls, cs)
            where: dict[int, set[str]] = collections.defaultdict(set)
            for turn in range(3):
                for i in range(12):
                    body = chat_request(image(i), text=f"question {turn}")
                    where[i].add(await served_by(url, body))
                    assert where[i] == {by_url[home(router, body).url]}
            assert all(len(w) == 1 for w in where.values())  # each image: one consumer
            used = {n for w in where.values() for n in w}
            assert len(used) >= 2  # 12 images over 3 consumers
            assert choices(router) == {"affinity": 36}

    run(scenario())


def test_a_chats_later_turns_follow_its_first_image() -> None:
    """A multi-turn chat resends its images and adds new ones: the first one keys it."""

    async def scenario() -> None:
        cs = consumers(4)
        async with fakes(*cs) as urls, router_at([], urls, **AFFINE) as (_router, url):
            turns = [chat_request(image(7), *(image(20 + j) for j in range(n))) for n in range(4)]
            assert len({await served_by(url, body) for body in turns}) == 1

    run(scenario())


def test_a_consumer_at_the_bound_is_skipped_for_the_next_in_the_ranking() -> None:
    body = chat_request(image(3))

    async def scenario() -> None:
        cs = consumers(3)
        async with (
            fakes(*cs) as urls,
            router_at([], urls, consumer_load_bound=2, **AFFINE) as (router, url),
        ):
            by_url = names(urls, cs)
            ranked = hrw_rank(media_key(media_parts(body)[0]), router.consumers.backends)
            assert await served_by(url, body) == by_url[ranked[0].url]
            ranked[0].in_flight = 2  # as if two long requests were decoding there
            assert await served_by(url, body) == by_url[ranked[1].url]
            ranked[1].in_flight = 2
            ranked[2].in_flight = 3  # all at the bound: the least busy, earliest ranked
            assert await served_by(url, body) == by_url[ranked[0].url]
            assert choices(router) == {"affinity": 1, "next_ranked": 1, "over_bound": 1}

    run(scenario())


def test_text_only_requests_and_completions_go_to_the_least_busy() -> None:
    async def scenario() -> None:
        cs = consumers(3)
        async with fakes(*cs) as urls, router_at([], urls, **AFFINE) as (router, url):
            for b, load in zip(router.consumers.backends, (3, 1, 2), strict=True):
                b.in_flight = load
            least = names(urls, cs)[router.consumers.backends[1].url]
            assert await served_by(url, chat_request(text="no image")) == least
            completion = {"model": "m", "prompt": "hi"}
            assert await served_by(url, completion, "/v1/completions") == least
            assert choices(router) == {"no_media": 2}

    run(scenario())


@pytest.mark.parametrize("mode", ["unavailable", "down"])
def test_a_failing_consumer_is_retried_on_the_next_in_the_ranking(mode: str) -> None:
    async def scenario() -> None:
        cs = [FakeBackend("consumer-bad", mode=mode), *consumers(2)]
        async with fakes(*cs) as urls:
            if mode == "down":
                urls[0] = "http://127.0.0.1:9"
            async with router_at([], urls, **AFFINE) as (router, url):
                # An image whose own consumer is the bad one.
                body = next(
                    b
                    for b in (chat_request(image(i)) for i in range(100))
                    if home(router, b).url == urls[0]
                )
                ranked = hrw_rank(media_key(media_parts(body)[0]), router.consumers.backends)
                second = names(urls, cs)[ranked[1].url]
                assert await served_by(url, body) == second
                assert choices(router) == {"affinity": 1, "next_ranked": 1}
                r = router.metrics.registry.get_sample_value
                assert r("encoderpool_router_consumer_retries_total") == 1
                assert await served_by(url, body) == second
                if mode == "down":  # ejected: the next request passes it over from the start
                    assert choices(router) == {"affinity": 1, "next_ranked": 2}
                else:  # a 503 ejects nothing (it may be the request's fault): tried again
                    assert choices(router) == {"affinity": 2, "next_ranked": 2}
                    assert len(cs[0].seen) == 2

    run(scenario())


def test_the_default_policy_is_least_busy_whatever_the_media() -> None:
    body = chat_request(image(5))

    async def scenario() -> None:
        cs = consumers(3)
        async with fakes(*cs) as urls, router_at([], urls) as (router, url):
            assert router.settings.consumer_policy == "least-busy"
            by_url = names(urls, cs)
            for least in router.consumers.backends:
                for b in router.consumers.backends:
                    b.in_flight = 0 if b is least else 1
                assert await served_by(url, body) == by_url[least.url]
            assert choices(router) == {"least_busy": 3}

    run(scenario())


def test_a_client_cannot_steer_its_request_with_anything_but_the_media() -> None:
    """uuids are dropped before the key is made (untrusted clients), and client params,
    headers or fields besides the media items never enter it."""

    async def scenario() -> None:
        cs = consumers(4)
        async with fakes(*cs) as urls, router_at([], urls, **AFFINE) as (_router, url):
            for i in range(4):
                plain = chat_request(image(i))
                first = await served_by(url, plain)
                for j in range(6):
                    steered = chat_request(image(i), text=f"steer {j}")
                    steered["messages"][0]["content"][0] = image_part(image(i), uuid=f"u{j}")
                    steered["ec_transfer_params"] = {"x": {"consumer": j}}
                    steered["user"] = f"tenant-{j}"
                    assert await served_by(url, steered) == first

    run(scenario())
