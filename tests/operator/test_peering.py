"""kopf's pause rule, as a replica applies it to stop its own loops (controller/peering.py).

The peering object's shape and the rule are kopf's internals (kopf==1.45.2, pinned in
requirements/constraints.txt): ``test_kopf_pauses_exactly_when_we_do`` runs kopf's own
peering code on the same statuses, so a kopf that changes either fails here, loudly,
instead of leaving a standby replica running passes. The real two-replica hand-over
is in tests/chart/test_rbac_chart.py.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from kopf._cogs.aiokits.aiotoggles import Toggle
from kopf._cogs.configs.configuration import OperatorSettings
from kopf._core.engines.peering import Peer as KopfPeer
from kopf._core.engines.peering import process_peering_event

from encoderpool_operator.controller.peering import Peer, Standby, outranked, peering_path

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
    peer = Peer(name="ep", namespace="ns", identity="me", priority=1)
    standby = Standby(kube, peer, interval=5)  # type: ignore[arg-type]
    assert standby.check() is True
    assert kube.calls == [("GET", peering_path("ep", "ns"), {"fieldSelector": "metadata.name=ep"})]
    kube.items = []  # no peering object (yet): nobody to defer to
    assert standby.check() is False


# ------------------------------------------------------------- against kopf itself


def kopf_entry(priority: int, seen_ago: float = 1.0, lifetime: int = 60) -> dict[str, Any]:
    """A peer's status entry as kopf writes it (its keep-alive: ``Peer.as_dict``)."""
    seen = datetime.now(timezone.utc) - timedelta(seconds=seen_ago)
    peer = KopfPeer(identity="x", priority=priority, lifetime=lifetime, lastseen=seen.isoformat())  # type: ignore[arg-type]
    entry: dict[str, Any] = peer.as_dict()
    return entry


def kopf_pauses(status: dict[str, Any], *, identity: str, priority: int) -> bool:
    """Whether kopf pauses the replica ``identity`` on this peering status."""
    settings = OperatorSettings()
    settings.peering.name = "ep"
    settings.peering.priority = priority

    async def main() -> bool:
        paused = Toggle(False)
        awake = asyncio.Event()
        awake.set()  # kopf would otherwise sleep until the blocking peers expire
        await process_peering_event(
            raw_event={
                "type": "MODIFIED",
                "object": {"metadata": {"name": "ep"}, "status": status},
            },
            namespace=None,
            resource=None,  # type: ignore[arg-type]
            identity="me",  # type: ignore[arg-type]
            settings=settings,
            autoclean=False,
            stream_pressure=awake,
            conflicts_found=paused,
        )
        return paused.is_on()

    return asyncio.run(main())


def test_kopf_writes_the_entry_shape_we_read() -> None:
    assert set(kopf_entry(3)) == {"priority", "lifetime", "lastseen"}


@pytest.mark.parametrize(
    "others",
    [
        {},
        {"other": kopf_entry(4)},
        {"other": kopf_entry(6)},
        {"other": kopf_entry(5)},
        {"other": kopf_entry(9, seen_ago=61)},
        {"other": kopf_entry(9, seen_ago=61, lifetime=120)},
        {"a": kopf_entry(4), "b": kopf_entry(5, seen_ago=90)},
    ],
    ids=["alone", "lower", "higher", "tie", "dead", "alive-longer", "lower-and-dead-tie"],
)
def test_kopf_pauses_exactly_when_we_do(others: dict[str, Any]) -> None:
    status = {"me": kopf_entry(5), **others}
    ours = outranked(status, identity="me", priority=5, now=datetime.now(timezone.utc))
    assert ours is kopf_pauses(status, identity="me", priority=5)
