"""The encoder-demand signal and the dispatch decision, on a fake clock."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from encoderpool_contracts.signals import (
    DISPATCH_DECISIONS,
    ENCODER_INFLIGHT_ITEMS,
    ENCODER_INFLIGHT_SECONDS,
    ENCODER_UNSERVED_ITEMS,
)
from encoderpool_router.demand import (
    REASONS,
    UNSERVED_WINDOW_S,
    Dispatch,
    EncoderDemand,
    FirstSeen,
    decide,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    value = registry.get_sample_value(name, labels)
    return value


def test_integral_is_the_time_in_flight_even_mid_encode() -> None:
    clock, reg = Clock(), CollectorRegistry()
    demand = EncoderDemand(["", "video"], registry=reg, clock=clock)
    with demand.track(""):
        clock.now += 2.0
        with demand.track(""):
            clock.now += 1.0
            # a scrape in the middle counts what was already spent: 2 s x 1 + 1 s x 2
            assert sample(reg, ENCODER_INFLIGHT_SECONDS, group="") == pytest.approx(4.0)
            assert sample(reg, ENCODER_INFLIGHT_ITEMS, group="") == 2
        clock.now += 1.0
    clock.now += 10.0  # nothing in flight: the integral stays
    assert sample(reg, ENCODER_INFLIGHT_SECONDS, group="") == pytest.approx(5.0)
    assert sample(reg, ENCODER_INFLIGHT_ITEMS, group="") == 0
    assert sample(reg, ENCODER_INFLIGHT_SECONDS, group="video") == 0


def test_an_item_that_fails_still_leaves_the_count() -> None:
    clock = Clock()
    demand = EncoderDemand([""], clock=clock)
    with pytest.raises(RuntimeError), demand.track(""):
        raise RuntimeError("producer failed")
    assert demand.in_flight("") == 0


def test_decisions_count_when_made_and_unserved_items_only_when_told() -> None:
    reg = CollectorRegistry()
    demand = EncoderDemand(["image"], registry=reg)
    text = generate_latest(reg).decode()
    for reason, to in REASONS.items():  # dashboards see zeros, not gaps
        assert f'{DISPATCH_DECISIONS}{{group="image",reason="{reason}",to="{to}"}} 0.0' in text
    assert f'{ENCODER_UNSERVED_ITEMS}{{group="image"}} 0.0' in text
    demand.record("image", Dispatch("consumer", "no_producer"))
    demand.record("image", Dispatch("producer", "always"))
    assert sample(reg, DISPATCH_DECISIONS, group="image", to="producer", reason="always") == 1
    # A decision is no demand yet: the request may still be refused.
    assert sample(reg, ENCODER_UNSERVED_ITEMS, group="image") == 0
    assert demand.unserved("addr:a", [("image", b"k1")]) == 1
    assert sample(reg, ENCODER_UNSERVED_ITEMS, group="image") == 1


def test_a_group_learnt_later_is_counted() -> None:
    reg = CollectorRegistry()
    demand = EncoderDemand([], registry=reg)
    demand.unserved("addr:a", [("audio", b"k")])
    assert sample(reg, ENCODER_UNSERVED_ITEMS, group="audio") == 1


def test_one_item_counts_once_per_window_whoever_sends_it() -> None:
    clock, reg = Clock(), CollectorRegistry()
    demand = EncoderDemand(["image"], registry=reg, clock=clock)
    for i in range(100):
        demand.unserved(f"addr:{i % 3}", [("image", b"same")])
        clock.now += 1.0
    assert sample(reg, ENCODER_UNSERVED_ITEMS, group="image") == 1
    clock.now += UNSERVED_WINDOW_S  # the window passed: demand again
    demand.unserved("addr:0", [("image", b"same")])
    assert sample(reg, ENCODER_UNSERVED_ITEMS, group="image") == 2
    # The same key in another group is another item.
    demand.unserved("addr:0", [("video", b"same")])
    assert sample(reg, ENCODER_UNSERVED_ITEMS, group="video") == 1


def test_one_client_counts_at_most_its_share_per_window() -> None:
    clock = Clock()
    first = FirstSeen(share=3, window_s=60.0, clock=clock)
    counted = [first.admit("addr:a", "image", bytes([i])) for i in range(10)]
    assert counted == [True] * 3 + [False] * 7
    # Another client's items still count; the ones refused above were not remembered.
    assert first.admit("addr:b", "image", bytes([5]))
    clock.now += 30.0
    assert not first.admit("addr:a", "image", b"later")
    clock.now += 30.0  # a's first three expire: its share is free again
    assert first.admit("addr:a", "image", b"later")
    assert first.clients() == 1  # b's key went with a's first three


def test_the_tables_are_bounded() -> None:
    clock = Clock()
    first = FirstSeen(share=1, window_s=60.0, capacity=100, clock=clock)
    for i in range(10_000):  # one key each from many clients
        first.admit(f"addr:{i}", "image", i.to_bytes(4, "big"))
    assert len(first) == 100
    assert first.clients() == 100
    # The oldest were forgotten early: a repeat of one of them counts again.
    assert first.admit("addr:x", "image", (0).to_bytes(4, "big"))
    clock.now += 61.0
    first.admit("addr:y", "image", b"new")
    assert (len(first), first.clients()) == (1, 1)


@pytest.mark.parametrize(
    ("policy", "ready", "backlog", "load", "expected"),
    [
        ("always", 0, 0, 5, Dispatch("consumer", "no_producer")),
        ("when-faster", 0, 0, 5, Dispatch("consumer", "no_producer")),
        ("always", 1, 9, 0, Dispatch("producer", "always")),
        # an idle consumer delays nobody: no hop for image-light traffic
        ("when-faster", 2, 0, 0, Dispatch("consumer", "consumer_idle")),
        # a busy consumer: the producers' queue per replica is shorter
        ("when-faster", 2, 2, 2, Dispatch("producer", "consumer_busy")),
        ("when-faster", 1, 2, 2, Dispatch("consumer", "producers_busy")),
        ("when-faster", 4, 7, 2, Dispatch("producer", "consumer_busy")),
    ],
)
def test_decide_at_equal_times_compares_queues(
    policy: str, ready: int, backlog: int, load: int, expected: Dispatch
) -> None:
    """What the router decides with no --encode-seconds: both sides priced by the same
    time, queue lengths decide (tests/router/test_dispatch.py has the timed cases)."""
    decided = decide(policy, ready, backlog, load, 0.1, 0.1)  # type: ignore[arg-type]
    assert decided == expected
