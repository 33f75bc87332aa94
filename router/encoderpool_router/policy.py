"""Which producer encodes an item, and which consumer serves a request.

Producers: rendezvous (highest-random-weight) hashing of the item's media key
over the producers, with a load bound. The same media lands on the same
producer, whose caches (vLLM's processor cache, its encoder cache, and with
RDMA the embedding still in its memory) then hit; when a producer joins or
leaves only the items that hashed to it move (no ring, no virtual nodes, and
nothing to rebuild on each EndpointSlice change). Random keys spread evenly;
a hot item or a burst that pushes its preferred producer past the bound goes
to the next producer in the item's own ranking (still stable, so repeats of it
keep hitting there), and only when every producer is past the bound to the
least loaded one.

Consumers, by ``--consumer-policy``: ``least-busy`` takes the consumer with the
fewest requests in flight (ties broken at random). ``media-affinity`` ranks the
consumers by the same rendezvous hashing of the request's first media key, with
a load bound as for producers, so a repeated image (or a multi-turn chat, whose
first image stays first) meets the consumer whose prefix and processor caches
already hold it; text-only requests fall back to least-busy. Both skip the
consumers already tried for this request and those ejected after a failure.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from encoderpool_router.backends import Backend, usable

# How a consumer was chosen (the ``choice`` label of encoderpool_router_consumer_choices_total).
ConsumerChoice = Literal["least_busy", "affinity", "next_ranked", "over_bound", "no_media"]
CONSUMER_CHOICES: tuple[ConsumerChoice, ...] = (
    "least_busy",  # --consumer-policy least-busy
    "affinity",  # media-affinity: the key's first-ranked consumer (its caches should hit)
    "next_ranked",  # a later one in the key's ranking: the first is busy, ejected or was tried
    "over_bound",  # every candidate at --consumer-load-bound: the least busy of them
    "no_media",  # media-affinity, but the request has no media item: least busy
)


def hrw_rank(key: bytes, backends: Sequence[Backend]) -> list[Backend]:
    """``backends`` from most to least preferred for ``key`` (rendezvous hashing)."""

    def weight(b: Backend) -> bytes:
        return hashlib.blake2b(key + b.url.encode(), digest_size=8).digest()

    return sorted(backends, key=weight, reverse=True)


def choose_producer(key: bytes, backends: Sequence[Backend], load_bound: int) -> Backend | None:
    """The item's first-ranked producer under ``load_bound`` in flight, else the least busy."""
    ranked = hrw_rank(key, usable(backends))
    for b in ranked:
        if b.in_flight < load_bound:
            return b
    return min(ranked, key=lambda b: b.in_flight, default=None)


def choose_consumer(backends: Sequence[Backend], exclude: Sequence[Backend] = ()) -> Backend | None:
    """The least busy consumer not yet tried; a tried one only when nothing else is left."""
    pool = usable(backends)
    fresh = [b for b in pool if b not in exclude] or pool
    if not fresh:
        return None
    least = min(b.in_flight for b in fresh)
    return random.choice([b for b in fresh if b.in_flight == least])  # noqa: S311


def choose_consumer_by_media(
    key: bytes | None,
    backends: Sequence[Backend],
    load_bound: int,
    exclude: Sequence[Backend] = (),
) -> tuple[Backend | None, ConsumerChoice]:
    """The first consumer in ``key``'s ranking that is usable, not yet tried and under
    ``load_bound`` in flight; if all are at the bound, the least busy (the earliest in
    the ranking among equals, so repeats still land together). ``key`` None (no media
    item): least busy. The ranking covers every known consumer, ejected ones included,
    so ``affinity`` means the key's own consumer, not merely the best one left.
    """
    if key is None:
        return choose_consumer(backends, exclude), "no_media"
    ranked = hrw_rank(key, backends)
    pool = usable(ranked)  # keeps the ranking's order
    fresh = [b for b in pool if b not in exclude] or pool
    for b in fresh:
        if b.in_flight < load_bound:
            return b, "affinity" if b is ranked[0] else "next_ranked"
    return min(fresh, key=lambda b: b.in_flight, default=None), "over_bound"


class RecentlyEncoded:
    """Media keys a producer encoded less than ``ttl_s`` ago (at most ``capacity`` of them).

    Multi-turn chats resend every earlier image each turn; with a transport
    where consumers find entries by hash alone (the shared volume), sending
    such an item to a producer again only costs a round trip. A hit skips the
    producer and sends no params for the item: the consumer loads the entry if
    it is still there and encodes the item itself if not (never an error). Not
    for transports whose consumers need the producer's params (RDMA).
    """

    def __init__(self, ttl_s: float, capacity: int = 1 << 16) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._until: OrderedDict[bytes, float] = OrderedDict()

    def add(self, key: bytes, now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        self._until[key] = t + self.ttl_s
        self._until.move_to_end(key)
        while len(self._until) > self.capacity:
            self._until.popitem(last=False)

    def fresh(self, key: bytes, now: float | None = None) -> bool:
        t = time.monotonic() if now is None else now
        until = self._until.get(key)
        if until is None:
            return False
        if until <= t:
            del self._until[key]
            return False
        return True
