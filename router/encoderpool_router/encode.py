"""Encoding a request's media items on producers, and the fallback to the consumer.

Each distinct item of a request goes alone to a producer of its modality's group
(``max_tokens: 1``), concurrently: at most ``--max-encodes-per-request`` of one request
and ``--max-producer-requests`` of all requests at once. The producers'
``ec_transfer_params`` are merged for the consumer. An item no producer encodes is left
to the consumer, which encodes it itself: its modality has no group, no producer slot
came free within ``--producer-timeout-s``, no producer is known, or the producer failed.
A failed encode never fails the request.

An item left to the consumer because its group had no producer ready is the group's
unserved demand: ``Local.unserved`` keeps it, and ``Encoder.unserved`` counts it once
the consumer accepted the request (``demand.EncoderDemand.unserved``).

``Encoder.decide`` is where an item's way is chosen; a group's ``Backlog`` (items
waiting for a producer slot, items in flight on each producer) and the producers'
seconds per item, measured from the round trips of the items they answer
(``demand.ProducerTimes``), are what it sees.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import aiohttp

from encoderpool_contracts import EC_TRANSFER_PARAMS, Announcement, raw_announcement
from encoderpool_router.backends import Backend, BackendSet, Calls, ProducerGroups
from encoderpool_router.body import ClientBody
from encoderpool_router.config import RouterSettings
from encoderpool_router.content import modality
from encoderpool_router.demand import EncoderDemand, decide
from encoderpool_router.intake import Media
from encoderpool_router.metrics import RouterMetrics
from encoderpool_router.parts import payload
from encoderpool_router.policy import RecentlyEncoded, choose_producer
from encoderpool_router.producer_request import encoder_request_parts
from encoderpool_router.protocol import CHAT_PATH
from encoderpool_router.upstream import JSON, Upstream, UpstreamError

logger = logging.getLogger(__name__)

# Where an item was encoded: the ``encoded`` label of encoderpool_router_media_items_total.
Encoded = Literal["remote", "local", "reused"]
# What ``Encoder.decide`` chose for an item: a producer, the consumer, or no encode (reused).
Way = Literal["producer", "local", "reused"]


class Backlog:
    """The work of one producer group, live: ``waiting``, items sent its way that wait for
    a slot among all clients' producer requests, and the items in flight on each of its
    producers (``Backend.in_flight``, kept by ``Calls.track``). ``group`` names it in the
    demand metrics: the Service that feeds it, or its set's role with static backends."""

    __slots__ = ("group", "producers", "waiting")

    def __init__(self, producers: BackendSet, group: str) -> None:
        self.producers = producers
        self.group = group
        self.waiting = 0

    @property
    def ready(self) -> int:
        """Producers known (ready endpoints, or the static list)."""
        return len(self.producers)

    def in_flight(self) -> dict[str, int]:
        """Items in flight per producer, by URL."""
        return {b.url: b.in_flight for b in self.producers.backends}

    def total(self) -> int:
        """Items waiting for a slot or in flight on the group's producers."""
        return self.waiting + sum(b.in_flight for b in self.producers.backends)

    def __repr__(self) -> str:
        return f"Backlog({self.producers.role}, waiting={self.waiting}, {self.in_flight()})"


class Local:
    """One request's items left to the consumer so far: how many, and which of them
    (group, media key) found no producer of their group ready."""

    __slots__ = ("items", "unserved")

    def __init__(self) -> None:
        self.items = 0
        self.unserved: list[tuple[str, bytes]] = []


class Encoder:
    """The producer side of the router: groups, their backlogs, the slots all requests
    share, recent encodes (``--reuse-encoded-s``) and the calls to producers."""

    def __init__(
        self,
        settings: RouterSettings,
        groups: ProducerGroups,
        upstream: Upstream,
        metrics: RouterMetrics,
        consumer_load: Callable[[], int] = lambda: 0,
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.metrics = metrics
        # The least requests in flight on a consumer: what encoding locally would delay.
        self.consumer_load = consumer_load
        # modality -> its group's backlog (modalities sharing a set share one backlog)
        names = {id(s): service for service, s in groups.services.items()}
        backlogs = {id(s): Backlog(s, names.get(id(s), s.role)) for s in groups.sets}
        self.demand = EncoderDemand(
            sorted(b.group for b in backlogs.values()),
            registry=metrics.registry,
            share=settings.max_items_per_client,
            encode_seconds=settings.encode_seconds,
        )
        self.backlogs = {m: backlogs[id(s)] for m, s in groups.by_modality.items()}
        self.recent = (
            RecentlyEncoded(settings.reuse_encoded_s) if settings.reuse_encoded_s else None
        )
        self.calls = Calls(
            settings.eject_s, metrics.producers_in_flight, metrics.producer_latency, metrics.error
        )
        self._slots = asyncio.Semaphore(settings.max_producer_requests)
        self._timeout = aiohttp.ClientTimeout(total=settings.producer_timeout_s)

    async def encode(
        self, body: ClientBody, media: Media, rid: str
    ) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
        """Each distinct item (an item repeated in the request is encoded once) on a
        producer, at most ``max_encodes_per_request`` at once; the merged params of those
        that answered, and the items (group, media key) that found no producer ready:
        count them with ``unserved`` once a consumer accepted the request."""
        by_key: dict[bytes, dict[str, Any]] = {}
        for key, part in zip(media.keys, media.parts, strict=True):
            by_key.setdefault(key, part)
        if len(media.parts) > len(by_key):
            self.metrics.items_by["duplicate"].inc(len(media.parts) - len(by_key))
        local = Local()
        if len(by_key) == 1:  # the common case: no semaphore, no gather
            ((key, part),) = by_key.items()
            results = [await self._encode_one(body, part, key, f"{rid}-enc0", local)]
        else:
            mine = asyncio.Semaphore(self.settings.max_encodes_per_request)

            async def one(
                i: int, key: bytes, part: dict[str, Any]
            ) -> tuple[Encoded, dict[str, Any]]:
                async with mine:
                    return await self._encode_one(body, part, key, f"{rid}-enc{i}", local)

            results = await asyncio.gather(
                *(one(i, key, part) for i, (key, part) in enumerate(by_key.items()))
            )
        merged: dict[str, Any] = {}
        for where, params in results:
            self.metrics.items_by[where].inc()
            merged.update(params)
        return merged, local.unserved

    def unserved(self, client: str, items: list[tuple[str, bytes]]) -> None:
        """A consumer accepted the request: its items that found no producer ready are
        the groups' unserved demand (each counted once, within the client's share).
        Empties ``items``, so a second call counts nothing."""
        if items:
            self.demand.unserved(client, items)
            items.clear()

    def decide(
        self, key: bytes, backlog: Backlog | None, modality: str, local: Local | None = None
    ) -> Way:
        """Where one item (``key``: its media key) of ``modality`` is encoded, given its
        group's backlog (None: its modality has no group): on a producer; ``local``, by the
        consumer; or ``reused``, by nobody, a producer having encoded it moments ago (the
        consumer finds the entry by hash, or encodes it if it is gone). ``local``: this
        request's items already left to the consumer. Every decision on a group is counted
        (``demand.record``); an item that found no producer ready joins
        ``local.unserved``, the group's unserved demand once the consumer accepts the
        request."""
        if backlog is None:
            return "local"
        if self.recent is not None and self.recent.fresh(key):
            return "reused"
        producer_s, encode_s = self.demand.costs(backlog.group, modality)
        dispatch = decide(
            self.settings.dispatch,
            backlog.ready,
            backlog.total(),
            self.consumer_load() + (local.items if local is not None else 0),
            producer_s,
            encode_s,
        )
        self.demand.record(backlog.group, dispatch)
        if dispatch.reason == "no_producer":
            self.metrics.error("producer_unavailable")
            if local is not None:
                local.unserved.append((backlog.group, key))
        return "producer" if dispatch.to == "producer" else "local"

    async def _encode_one(
        self, body: ClientBody, part: dict[str, Any], key: bytes, rid: str, local: Local
    ) -> tuple[Encoded, dict[str, Any]]:
        """One item: ("remote", its params) from a producer, else ("local" | "reused", {})."""
        kind = modality(part)
        backlog = self.backlogs.get(kind)
        way = self.decide(key, backlog, kind, local)
        if way == "local":
            local.items += 1
        if way != "producer":
            return way, {}
        assert backlog is not None
        backlog.waiting += 1
        try:  # a slot among all clients' producer requests, or the consumer encodes it
            await asyncio.wait_for(self._slots.acquire(), self.settings.producer_timeout_s)
        except TimeoutError:
            self.metrics.error("producer_saturated")
            return "local", {}
        finally:
            backlog.waiting -= 1
        try:
            with self.demand.track(backlog.group):
                return await self._on_producer(body, part, key, backlog, kind, rid)
        finally:
            self._slots.release()

    async def _on_producer(
        self,
        body: ClientBody,
        part: dict[str, Any],
        key: bytes,
        backlog: Backlog,
        kind: str,
        rid: str,
    ) -> tuple[Encoded, dict[str, Any]]:
        producers = backlog.producers.backends
        producer = choose_producer(key, producers, self.settings.producer_load_bound)
        if producer is None:  # every producer of the group ejected
            self.metrics.error("producer_unavailable")
            return "local", {}
        try:
            with self.calls.track(producer):
                # It waits behind the items already in flight there: its round trip over
                # their count (itself included) is the producer's time per item. Only an
                # answer is timed: a failure ejects the producer, or was the item's own.
                sent, in_flight = time.monotonic(), producer.in_flight
                params = await self._post(
                    producer, encoder_request_parts(body.data, part, body.literal), rid
                )
            self.demand.observe(backlog.group, kind, time.monotonic() - sent, in_flight)
        except UpstreamError as e:
            logger.warning(
                "request %s: producer %s failed (%s); the consumer encodes the item",
                rid,
                producer.url,
                e,
            )
            return "local", {}
        if self.recent is not None:
            self.recent.add(key)
        return "remote", params

    async def _post(
        self, producer: Backend, req: Sequence[bytes | memoryview], rid: str
    ) -> dict[str, Any]:
        """The producer's ``ec_transfer_params`` for one item's request; ``UpstreamError``
        when it gives none."""
        try:
            async with self.upstream.session.post(
                producer.url + CHAT_PATH,
                data=payload(req, JSON),  # the client's literal as a view, not joined
                headers=self.upstream.headers(rid, json_body=True),
                timeout=self._timeout,
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    # A 4xx but 401/403 is the item's (an undecodable image): ejecting the
                    # producer for it, or counting it as the producer's failure, would let
                    # one client's bad item cost every client its encodes or page a person.
                    items_fault = 400 <= resp.status < 500 and resp.status not in (401, 403)
                    raise UpstreamError(
                        "producer_refused_item" if items_fault else "producer_error",
                        f"HTTP {resp.status}: {raw[:200]!r}",
                        eject=not items_fault,
                    )
        except TimeoutError:
            raise UpstreamError(
                "producer_timeout", f"no answer in {self.settings.producer_timeout_s}s", eject=True
            ) from None
        except aiohttp.ClientError as e:
            raise UpstreamError("producer_error", repr(e), eject=True) from None
        try:
            params = json.loads(raw).get(EC_TRANSFER_PARAMS)
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict) or not params:
            raise UpstreamError(
                "producer_error", f"answer without {EC_TRANSFER_PARAMS}: {raw[:200]!r}", eject=True
            )
        check_announcements(producer, params, rid)
        return params


def check_announcements(producer: Backend, params: dict[str, Any], rid: str) -> None:
    """Warn when a producer announces items in a format this router does not know.

    The params still go to the consumer unchanged (it validates them itself, and
    other connectors announce nothing); the warning points at version skew
    between the producer image and the router.
    """
    for mm_hash in params:
        raw = raw_announcement(params, mm_hash)
        if raw is None:
            continue
        try:
            Announcement.parse(raw)
        except ValueError as e:
            logger.warning(
                "request %s: producer %s: item %r: %s (a producer of another version?)",
                rid,
                producer.url,
                mm_hash[:80],
                e,
            )
