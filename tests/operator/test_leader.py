"""Leader election on a Lease (controller/leader.py) with a fake clock and a fake API server.

``FakeLeases`` keeps one Lease the way the API server does: ``resourceVersion`` bumps on
every write, a PUT with a stale one is a 409, a POST of an existing one is a 409. The
real two-process failover is in tests/operator/test_leader_failover.py.
"""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any

import pytest

from encoderpool_operator.controller.leader import (
    Conflict,
    Elector,
    GuardedKube,
    NotLeading,
    Timing,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeLeases:
    name = "ep-lease"

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False  # the API server cannot be reached
        self.writes: list[str] = []  # holderIdentity of each successful write

    def get(self) -> dict[str, Any] | None:
        if self.down:
            raise ConnectionError("unreachable")
        return copy.deepcopy(self.lease)

    def _store(self, lease: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        lease = copy.deepcopy(lease)
        lease["metadata"]["resourceVersion"] = str(self.version)
        self.lease = lease
        self.writes.append(lease["spec"]["holderIdentity"])
        return copy.deepcopy(lease)

    def create(self, lease: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise ConnectionError("unreachable")
        if self.lease is not None:
            raise Conflict("exists")
        return self._store(lease)

    def replace(self, lease: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise ConnectionError("unreachable")
        assert self.lease is not None
        if lease["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise Conflict("stale resourceVersion")
        return self._store(lease)


WALL = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)


def elector(leases: FakeLeases, clock: Clock, name: str) -> Elector:
    return Elector(leases, name, Timing(15, 10, 2), clock=clock, wall=lambda: WALL)


def test_the_first_replica_creates_the_lease_and_leads() -> None:
    leases, clock = FakeLeases(), Clock()
    a = elector(leases, clock, "a")
    assert not a.leading()
    assert a.round()
    spec = leases.lease["spec"]  # type: ignore[index]
    assert spec["holderIdentity"] == "a"
    assert spec["leaseDurationSeconds"] == 15
    assert spec["leaseTransitions"] == 0
    assert spec["acquireTime"] == spec["renewTime"] == "2026-12-07T12:00:00.000000Z"


def test_a_renewal_keeps_acquire_time_and_transitions() -> None:
    leases, clock = FakeLeases(), Clock()
    a = elector(leases, clock, "a")
    a.round()
    clock.t += 2
    a.wall = lambda: WALL.replace(second=2)
    assert a.round()
    spec = leases.lease["spec"]  # type: ignore[index]
    assert spec["acquireTime"] == "2026-12-07T12:00:00.000000Z"
    assert spec["renewTime"] == "2026-12-07T12:00:02.000000Z"
    assert spec["leaseTransitions"] == 0
    assert leases.writes == ["a", "a"]


def test_a_live_holder_keeps_the_lease() -> None:
    leases, clock = FakeLeases(), Clock()
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    a.round()
    for _ in range(20):  # 40 s: a renews every 2 s, b never gets it
        clock.t += 2
        assert a.round()
        assert not b.round()
    assert set(leases.writes) == {"a"}


def test_a_dead_holder_is_replaced_after_the_lease_duration_by_the_candidates_clock() -> None:
    leases, clock = FakeLeases(), Clock()
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    a.round()
    b.round()  # b first sees a's record now
    died = clock.t
    while not b.round():
        clock.t += 2
        assert clock.t - died <= 16
    assert clock.t - died >= 15  # never before the record is a lease duration old
    spec = leases.lease["spec"]  # type: ignore[index]
    assert spec["holderIdentity"] == "b"
    assert spec["leaseTransitions"] == 1


def test_a_candidate_that_just_started_waits_a_full_duration_however_old_the_renew_time() -> None:
    """Clocks of two machines are never compared: a renewTime long past says nothing."""
    leases, clock = FakeLeases(), Clock()
    a = elector(leases, clock, "a")
    a.round()
    leases.lease["spec"]["renewTime"] = "2000-01-01T00:00:00.000000Z"  # type: ignore[index]
    b = elector(leases, clock, "b")
    assert not b.round()
    clock.t += 14.9
    assert not b.round()
    clock.t += 0.2
    assert b.round()


def test_a_holder_cut_off_stops_writing_before_another_can_acquire() -> None:
    """The heart of it: renew deadline (10 s) < lease duration (15 s)."""
    leases, clock = FakeLeases(), Clock()
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    kube = GuardedKube(None)
    kube.may_write = a.leading
    a.round()
    b.round()
    last_renewal = clock.t
    a_stopped = b_started = None
    while b_started is None:
        clock.t += 0.5
        if a_stopped is None and not a.leading():
            a_stopped = clock.t
        leases.down = True  # a no longer reaches the API server; b still does
        a.round()
        leases.down = False
        if b.round():
            b_started = clock.t
    assert a_stopped is not None
    assert a_stopped - last_renewal <= 10
    assert b_started - last_renewal >= 15
    assert b_started - a_stopped >= 5
    with pytest.raises(NotLeading):  # a's client refuses writes now
        kube.request("PATCH", "/api/v1/namespaces/x/configmaps/y", kind="ConfigMap")


def test_two_candidates_racing_for_a_free_lease_one_wins() -> None:
    leases, clock = FakeLeases(), Clock()
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    stale = None

    real_get = leases.get

    def get_then_remember() -> dict[str, Any] | None:
        nonlocal stale
        stale = real_get()
        return stale

    a.round()
    a._until = float("-inf")  # a stepped down, its record says it still holds
    clock.t += 16
    b.round()  # b first sees the record
    clock.t += 16
    leases.get = get_then_remember  # type: ignore[method-assign]
    assert b.round()
    leases.get = lambda: stale  # type: ignore[method-assign]  # a read before b wrote
    assert not a.round()  # a's PUT carries the stale resourceVersion: 409
    assert leases.lease["spec"]["holderIdentity"] == "b"  # type: ignore[index]


def test_an_unreachable_api_server_ends_leadership_at_the_renew_deadline() -> None:
    leases, clock = FakeLeases(), Clock()
    a = elector(leases, clock, "a")
    a.round()
    leases.down = True
    clock.t += 9.9
    assert not a.round() or a.leading()  # still inside the deadline
    assert a.leading()
    clock.t += 0.2
    assert not a.leading()
    leases.down = False
    assert a.round()  # nobody took it: renewing its own record resumes
    assert leases.lease["spec"]["leaseTransitions"] == 0  # type: ignore[index]


def test_callbacks_and_release() -> None:
    leases, clock = FakeLeases(), Clock()
    events: list[str] = []
    a = elector(leases, clock, "a")
    a.on_started, a.on_stopped = lambda: events.append("started"), lambda: events.append("stopped")
    a.round()
    a.settle()
    a.settle()
    assert events == ["started"]
    a.release()
    assert events == ["started", "stopped"]
    spec = leases.lease["spec"]  # type: ignore[index]
    assert spec["holderIdentity"] is None
    b = elector(leases, clock, "b")
    assert b.round()  # a released lease is free at once
    assert leases.lease["spec"]["leaseTransitions"] == 1  # type: ignore[index]


def test_the_guard_lets_lease_writes_and_reads_through() -> None:
    kube = GuardedKube(None)
    kube.may_write = lambda: False
    with pytest.raises(NotLeading):
        kube.request("POST", "/api/v1/namespaces/x/events", kind="Event")
    with pytest.raises(AttributeError):  # passed the guard; the None client fails
        kube.request("PUT", "/apis/coordination.k8s.io/v1/namespaces/x/leases/l", kind="Lease")
    with pytest.raises(AttributeError):
        kube.request("GET", "/api/v1/namespaces/x/configmaps/y", kind="ConfigMap")


@pytest.mark.parametrize(("retry", "renew", "duration"), [(2, 15, 15), (10, 10, 15), (0, 5, 15)])
def test_timing_must_be_ordered(retry: float, renew: float, duration: float) -> None:
    with pytest.raises(ValueError, match="retry < renew deadline < lease duration"):
        Timing(duration, renew, retry)
