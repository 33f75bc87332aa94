"""Encoder demand, as the producers' autoscaler reads it, and where each item is encoded.

The router is the one place that sees every media item, wherever it is encoded, so it
exports the producers' scaling signal (names in ``encoderpool_contracts.signals``):

- the time integral of items in flight to each producer group. Its rate over a window
  is the mean number of items in flight then (Little's law): the encoder seconds per
  second asked of the group, exact whatever the scrape interval, where a gauge sampled
  every 15 s would see bursts or miss them;
- the items that wanted a producer but found none ready (the group at zero or all
  ejected): the consumer encoded them, and their rate wakes the group. An item counts
  only once the consumer accepted its request (a 2xx, or the start of a 200 stream: a
  request it refuses asked nothing of any encoder), once per media key within
  ``UNSERVED_WINDOW_S`` (repeats of one image are one item of demand), and one client's
  at most ``share`` of them within that window (its share of the producers' items):
  no client alone can hold a group awake with requests that cost it nothing.

``decide`` is the dispatch decision: with ``when-faster`` an item goes to a producer
only when that is expected to cost less than the consumer encoding it, both in seconds.
Encoding on the consumer runs inside its engine step, so it delays this request and every
request the consumer is running by one encode: ``encode_s x (1 + consumer load)``. On a
producer the item waits behind the group's queue per ready producer and is then encoded,
the hop included: ``(queue per replica + 1) x producer seconds per item``, a time the
router measures itself (``ProducerTimes``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from encoderpool_contracts.metrics import family
from encoderpool_contracts.signals import (
    DISPATCH_DECISIONS,
    ENCODER_INFLIGHT_ITEMS,
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
    LABEL_GROUP,
    PRODUCER_ITEM_SECONDS,
)

DispatchPolicy = Literal["always", "when-faster"]
DISPATCH_POLICIES: tuple[DispatchPolicy, ...] = ("always", "when-faster")
Target = Literal["producer", "consumer"]
# Why an item went where it went (the ``reason`` label; pre-created for dashboards).
REASONS: dict[str, Target] = {
    "always": "producer",  # --dispatch always, a producer ready
    "consumer_busy": "producer",  # when-faster: the producer's wait is the shorter
    "consumer_idle": "consumer",  # when-faster: nothing else on the consumer to delay
    "producers_busy": "consumer",  # when-faster: the producer's wait is the longer
    "no_producer": "consumer",  # no producer of the group ready (at zero, or ejected)
}


@dataclass(frozen=True)
class Dispatch:
    to: Target
    reason: str


def decide(
    policy: DispatchPolicy,
    producers_ready: int,
    producer_backlog: int,
    consumer_load: int,
    producer_s: float,
    encode_s: float,
) -> Dispatch:
    """Where one item is encoded.

    ``producer_backlog``: items waiting for or in flight to the group; ``consumer_load``:
    requests in flight on the consumer this request goes to, plus the items of this
    request already left to it (each one it encodes delays the others); ``producer_s``:
    the group's seconds per item, hop included; ``encode_s``: the consumer's encode of
    the item (``ProducerTimes``). A tie stays on the consumer: no hop for nothing.
    """
    if producers_ready <= 0:
        return Dispatch("consumer", "no_producer")
    if policy == "always":
        return Dispatch("producer", "always")
    remote = (producer_backlog / producers_ready + 1) * producer_s
    local = (1 + consumer_load) * encode_s
    if remote < local:
        return Dispatch("producer", "consumer_busy")
    return Dispatch("consumer", "consumer_idle" if consumer_load == 0 else "producers_busy")


# A producer's seconds per item: the weight of each new observation in the running mean
# (the last ten items carry nine tenths of it), and how fast a mean no item refreshes
# fades back to its prior (half of the way every minute): when-faster stops sending to a
# group that looked slow, so only time can tell it the group recovered.
ITEM_WEIGHT = 0.2
FADE_HALF_LIFE_S = 60.0
# The hop to a producer and back before any is measured (two HTTP messages over the pod
# network, the producer's request handling, the entry's publication): the prior is the
# modality's --encode-seconds plus this.
HOP_PRIOR_S = 0.02
# A modality without --encode-seconds: both costs use the producers' time (this prior
# before any is measured), so the value cancels out and the rule compares queues.
UNKNOWN_ENCODE_S = 0.1


class ProducerTimes:
    """Seconds per item on each group's producers, as the router measures them, and what
    the consumer's own encode is taken to cost.

    Per (group, modality): a running mean (exponentially weighted) of each answered
    item's round trip divided by the items in flight on its producer when it was sent,
    itself included, since it waited behind them (a batching producer answers them
    together: the division gives its time per item all the same). Items other routers
    send make a round trip longer without being counted here; the queue this router sees
    is shorter by as much, so the product stays near the wait. Before the first answer
    the mean is its prior: the modality's ``encode_seconds`` (the width Job's warm encode,
    on the pool's hardware) plus ``HOP_PRIOR_S``.

    The consumer's encode (``encode_s``) is the least of the two upper bounds on it: the
    width Job's time, for the largest item the model admits, and the producers' time per
    item of this traffic, hop included (the same encoder on the same kind of hardware,
    taken as the consumer's; the width Job runs with the producers' resources unless
    told otherwise). So an idle consumer always encodes an item itself, and with no
    ``encode_seconds`` for a modality the decision is the queue comparison whatever the
    producers take.

    Memory: one mean per (group, modality) the router routes; not thread-safe: the caller
    holds its own lock.
    """

    def __init__(
        self,
        encode_seconds: Mapping[str, float],
        clock: Callable[[], float] = time.monotonic,
        weight: float = ITEM_WEIGHT,
        half_life_s: float = FADE_HALF_LIFE_S,
    ) -> None:
        assert 0 < weight <= 1, weight
        assert half_life_s > 0, half_life_s
        self.encode_seconds = dict(encode_seconds)
        self.weight = weight
        self.half_life_s = half_life_s
        self._clock = clock
        self._means: dict[tuple[str, str], tuple[float, float]] = {}  # -> (mean, when)

    def prior(self, modality: str) -> float:
        """A group's seconds per item of ``modality`` before any answer."""
        return self.encode_seconds.get(modality, UNKNOWN_ENCODE_S) + HOP_PRIOR_S

    def producer_s(self, group: str, modality: str) -> float:
        """The group's seconds per item, hop included: the mean, faded toward the prior
        by the time since its last observation."""
        prior = self.prior(modality)
        seen = self._means.get((group, modality))
        if seen is None:
            return prior
        mean, when = seen
        fade = math.pow(0.5, max(0.0, self._clock() - when) / self.half_life_s)
        return prior + (mean - prior) * fade

    def encode_s(self, group: str, modality: str) -> float:
        """The consumer's encode of one item (see the class)."""
        producer = self.producer_s(group, modality)
        given = self.encode_seconds.get(modality)
        return producer if given is None else min(given, producer)

    def observe(self, group: str, modality: str, round_trip_s: float, in_flight: int) -> None:
        """An item answered after ``round_trip_s``, sent with ``in_flight`` items (itself
        included) in flight on its producer."""
        assert in_flight >= 1, in_flight
        per_item = max(0.0, round_trip_s) / in_flight
        mean = self.producer_s(group, modality)
        self._means[(group, modality)] = (mean + self.weight * (per_item - mean), self._clock())

    def means(self) -> Iterator[tuple[str, str, float]]:
        """(group, modality, seconds per item) of every pair observed so far."""
        for group, modality in list(self._means):
            yield group, modality, self.producer_s(group, modality)


# An unserved item is counted once per media key within this window: the wake signal's
# own (the operator's wake query is a rate over 5 minutes), so the same image sent again
# and again while a group sleeps is one item of demand, not one per request.
UNSERVED_WINDOW_S = 300.0
# Media keys remembered for that window, at most (about 100 bytes each): past it the
# oldest are forgotten early, and a repeat of one of them may count again.
UNSERVED_KEYS = 1 << 14


class FirstSeen:
    """Which unserved items count: each media key once within ``window_s``, and one
    client's at most ``share`` of the keys counted within that window.

    At most ``capacity`` keys are held, oldest first out; a client is held only while
    keys it counted are, so neither table outgrows ``capacity``. Not thread-safe: the
    caller holds its own lock.
    """

    def __init__(
        self,
        share: int,
        window_s: float = UNSERVED_WINDOW_S,
        capacity: int = UNSERVED_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert share >= 1, share
        assert window_s > 0, window_s
        assert capacity >= 1, capacity
        self.share = share
        self.window_s = window_s
        self.capacity = capacity
        self._clock = clock
        # (group, key) -> (when it stops counting, the client it counted for), in the
        # order counted: with one window for all, also the order they expire in.
        self._keys: OrderedDict[tuple[str, bytes], tuple[float, str]] = OrderedDict()
        self._by_client: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def clients(self) -> int:
        return len(self._by_client)

    def admit(self, client: str, group: str, key: bytes) -> bool:
        """Whether ``client``'s item ``key`` of ``group`` counts now (and remember it if so)."""
        now = self._clock()
        while self._keys:
            _, (until, _) = next(iter(self._keys.items()))
            if until > now:
                break
            self._forget()
        entry = (group, key)
        if entry in self._keys:
            return False
        held = self._by_client.get(client, 0)
        if held >= self.share:
            return False
        self._keys[entry] = (now + self.window_s, client)
        self._by_client[client] = held + 1
        while len(self._keys) > self.capacity:
            self._forget()
        return True

    def _forget(self) -> None:
        """Drop the oldest key, and its client with its last key."""
        _, (_, client) = self._keys.popitem(last=False)
        held = self._by_client[client] - 1
        if held:
            self._by_client[client] = held
        else:
            del self._by_client[client]


class _Group:
    __slots__ = ("in_flight", "integral", "since", "unserved")

    def __init__(self, now: float) -> None:
        self.in_flight = 0
        self.integral = 0.0
        self.since = now
        self.unserved = 0


class EncoderDemand(Collector):
    """Items in flight per producer group, their time integral, unserved items, and the
    producers' measured seconds per item (``ProducerTimes``).

    Thread-safe (the EndpointSlice watchers and the event loop both read it); the
    integral is brought up to date on every change and every scrape, so a scrape in the
    middle of a long encode counts the seconds already spent.
    """

    def __init__(
        self,
        groups: Iterable[str],
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        share: int = 64,  # the router passes --max-items-per-client
        encode_seconds: Mapping[str, float] | None = None,  # --encode-seconds
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._first = FirstSeen(share, clock=clock)
        self._times = ProducerTimes(encode_seconds or {}, clock=clock)
        now = clock()
        self._groups = {g: _Group(now) for g in groups}
        self._decisions: dict[tuple[str, str], int] = {
            (g, r): 0 for g in self._groups for r in REASONS
        }
        if registry is not None:
            registry.register(self)

    def _group(self, group: str) -> _Group:
        g = self._groups.get(group)
        if g is None:  # a group the router learnt later (its spec changed): count it too
            g = self._groups[group] = _Group(self._clock())
            for r in REASONS:
                self._decisions[(group, r)] = 0
        return g

    def _advance(self, g: _Group) -> None:
        now = self._clock()
        g.integral += g.in_flight * (now - g.since)
        g.since = now

    def in_flight(self, group: str) -> int:
        with self._lock:
            return self._group(group).in_flight

    @contextmanager
    def track(self, group: str) -> Iterator[None]:
        """One item in flight to ``group`` for the duration of the block."""
        with self._lock:
            g = self._group(group)
            self._advance(g)
            g.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._advance(g)
                g.in_flight -= 1

    def record(self, group: str, dispatch: Dispatch) -> None:
        """Count a decision (when it is made: the request may still be refused)."""
        with self._lock:
            self._group(group)
            self._decisions[(group, dispatch.reason)] += 1

    def costs(self, group: str, modality: str) -> tuple[float, float]:
        """(the group's seconds per item, the consumer's encode) of one item of
        ``modality``: what ``decide`` weighs."""
        with self._lock:
            return (
                self._times.producer_s(group, modality),
                self._times.encode_s(group, modality),
            )

    def observe(self, group: str, modality: str, round_trip_s: float, in_flight: int) -> None:
        """A producer of ``group`` answered an item (``ProducerTimes.observe``)."""
        with self._lock:
            self._group(group)
            self._times.observe(group, modality, round_trip_s, in_flight)

    def unserved(self, client: str, items: Iterable[tuple[str, bytes]]) -> int:
        """Count ``client``'s items (group, media key) that found no producer ready, once
        a consumer accepted their request: each key once within the window, the client's
        at most its share (``FirstSeen``). Returns how many counted."""
        counted = 0
        with self._lock:
            for group, key in items:
                if self._first.admit(client, group, key):
                    self._group(group).unserved += 1
                    counted += 1
        return counted

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            ENCODER_INFLIGHT_ITEMS,
            "Media items in flight to each producer group.",
            labels=[LABEL_GROUP],
        )
        seconds = CounterMetricFamily(
            family(ENCODER_INFLIGHT_SECONDS),
            "Time integral of media items in flight to each producer group: its rate is "
            "the mean number in flight (encoder seconds per second asked of the group).",
            labels=[LABEL_GROUP],
        )
        unserved = CounterMetricFamily(
            family(ENCODER_UNSERVED_ITEMS),
            "Media items that found no producer of their group ready (the consumer encoded "
            "them), counted once a consumer accepted their request, each item once per "
            "window and one client's at most its share: demand that wakes a group scaled "
            "to zero.",
            labels=[LABEL_GROUP],
        )
        decisions = CounterMetricFamily(
            family(DISPATCH_DECISIONS),
            "Where each media item was sent to be encoded, and why.",
            labels=[LABEL_GROUP, "to", "reason"],
        )
        item_seconds = GaugeMetricFamily(
            PRODUCER_ITEM_SECONDS,
            "Seconds per media item on each producer group, hop included, as the router "
            "measured them (a running mean of round trips per item in flight, fading back "
            "to its prior when no item refreshes it): what --dispatch when-faster weighs. "
            "Absent until a producer of the group answered an item of the modality.",
            labels=[LABEL_GROUP, "modality"],
        )
        with self._lock:
            for name, g in self._groups.items():
                self._advance(g)
                gauge.add_metric([name], g.in_flight)
                seconds.add_metric([name], g.integral)
                unserved.add_metric([name], g.unserved)
            for (name, reason), n in self._decisions.items():
                decisions.add_metric([name, REASONS[reason], reason], n)
            for name, modality, per_item in self._times.means():
                item_seconds.add_metric([name, modality], per_item)
        yield from (gauge, seconds, unserved, decisions, item_seconds)
