"""The controller's decisions that need no cluster: which pool an event marks, and
which condition changes become Events. The passes themselves run on the control
plane in tests/operator/test_operator.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from encoderpool_operator.cache import Cache
from encoderpool_operator.controller import Controller
from encoderpool_operator.controller.events import transition_events
from encoderpool_operator.kube import Kube
from encoderpool_operator.naming import LABEL_POOL
from encoderpool_operator.settings import OperatorSettings


def pool(ready: str | None) -> dict[str, Any]:
    conditions = [] if ready is None else [{"type": "Ready", "status": ready}]
    return {"metadata": {"name": "p", "namespace": "ns"}, "status": {"conditions": conditions}}


@pytest.mark.parametrize("was", [None, "False", "True"])
def test_a_problem_is_a_warning_whatever_the_pool_was(was: str | None) -> None:
    events = transition_events(pool(was), [("WidthsMeasured", "WidthJobFailed", "exit 1")])
    assert events == [("Warning", "WidthJobFailed", "WidthsMeasured: exit 1")]


def test_leaving_ready_is_news_and_reaching_it_is_not() -> None:
    leaving = [("Ready", "PodsNotReady", "consumers: 0/1 pods available")]
    assert transition_events(pool("True"), leaving) == [
        ("Normal", "PodsNotReady", "Ready: consumers: 0/1 pods available")
    ]
    reaching = [("Ready", "AllAvailable", "widths measured")]
    assert transition_events(pool("False"), reaching) == []
    assert transition_events(pool("True"), [("ConsumersAvailable", "RollingOut", "1/2")]) == []


def controller() -> Controller:
    settings = OperatorSettings(settle_seconds=0.0)
    return Controller(settings, Kube(None), Cache({}, {}), elector=None)


def test_a_new_spec_is_marked_at_once_and_a_status_write_after_the_settle_time() -> None:
    async def main() -> None:
        c = controller()
        new = {"metadata": {"name": "p", "namespace": "ns", "generation": 2}, "status": {}}
        c.pool_event("ADDED", new)
        assert len(c.queue) == 1
        assert c.pools == {("ns", "p")}
        assert await c.queue.get() == (("ns", "p"), "event")
        c.queue.done(("ns", "p"))
        seen = {**new, "status": {"observedGeneration": 2}}
        c.pool_event("MODIFIED", seen)
        assert len(c.queue) == 0  # coalesced: after settle_seconds
        await asyncio.sleep(0.01)
        assert len(c.queue) == 1
        c.pool_event("DELETED", seen)
        assert c.pools == set()
        c.stop()

    asyncio.run(main())


def test_a_child_marks_the_pool_its_label_names_and_nothing_else() -> None:
    async def main() -> None:
        c = controller()
        c.child_changed({"namespace": "ns", "labels": {LABEL_POOL: "p"}})
        c.child_changed({"namespace": "ns", "labels": {}})
        await asyncio.sleep(0.01)
        assert await c.queue.get() == (("ns", "p"), "requeue")
        assert len(c.queue) == 0
        c.stop()

    asyncio.run(main())
