"""kopf's pause rule, as a replica applies it to stop its own loops (peering.py).

The real two-replica hand-over is in tests/chart/test_rbac_chart.py.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from encoderpool_operator.peering import Standby, outranked, peering_path

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)


def peer(priority: int, seen_ago: float = 1.0, lifetime: int = 60) -> dict[str, Any]:
    seen = NOW - timedelta(seconds=seen_ago)
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen.isoformat()}


@pytest.mark.parametrize(
    ("status", "paused"),
    [
        ({}, False),
        ({"me": peer(5)}, False),
        ({"me": peer(5), "other": peer(4)}, False),
        ({"me": peer(5), "other": peer(6)}, True),
        ({"me": peer(5), "other": peer(5)}, True),  # a tie pauses both, as kopf does
        ({"me": peer(5), "other": peer(9, seen_ago=61)}, False),  # dead: lifetime passed
        ({"me": peer(5), "other": peer(9, seen_ago=61, lifetime=120)}, True),
        ({"me": peer(5), "other": {"priority": "x", "lastseen": "now"}}, False),  # garbage
        ({"me": peer(5), "other": {"priority": 9}}, False),  # no lastseen: not counted
    ],
)
def test_kopfs_rule_with_a_known_identity(status: dict[str, Any], paused: bool) -> None:
    assert outranked(status, identity="me", priority=5, now=NOW) is paused


def test_without_an_identity_one_entry_of_our_priority_is_us() -> None:
    assert not outranked({"x": peer(5)}, identity=None, priority=5, now=NOW)
    assert outranked({"x": peer(5), "y": peer(5)}, identity=None, priority=5, now=NOW)
    assert outranked({"x": peer(5), "y": peer(7)}, identity=None, priority=5, now=NOW)
    assert not outranked({"x": peer(5), "y": peer(3)}, identity=None, priority=5, now=NOW)


def test_a_zulu_timestamp_parses() -> None:
    seen = (NOW - timedelta(seconds=3)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    status = {"me": peer(1), "other": {"priority": 2, "lifetime": 60, "lastseen": seen}}
    assert outranked(status, identity="me", priority=1, now=NOW)


def test_paths_name_the_scope() -> None:
    assert peering_path("p", None) == "/apis/kopf.dev/v1/clusterkopfpeerings"
    assert peering_path("p", "ns") == "/apis/kopf.dev/v1/namespaces/ns/kopfpeerings"


class FakeKube:
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.calls: list[tuple[str, str, dict[str, str] | None]] = []

    def request(self, method: str, path: str, query: Any = None, **_: Any) -> Any:
        self.calls.append((method, path, query))
        return {"items": self.items}


def test_a_check_lists_the_peering_object_by_name() -> None:
    now = datetime.now(timezone.utc).isoformat()
    higher = {"priority": 9, "lifetime": 60, "lastseen": now}
    kube = FakeKube([{"metadata": {"name": "ep"}, "status": {"me": {}, "other": higher}}])
    standby = Standby(
        kube,  # type: ignore[arg-type]
        name="ep",
        namespace="ns",
        identity="me",
        priority=1,
        interval=5,
    )
    assert standby.check() is True
    assert kube.calls == [("GET", peering_path("ep", "ns"), {"fieldSelector": "metadata.name=ep"})]
    kube.items = []  # no peering object (yet): nobody to defer to
    assert standby.check() is False
