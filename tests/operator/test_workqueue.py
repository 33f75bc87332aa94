"""The work queue: one entry per pool, no pass of a pool twice at once, bounded back-off."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from encoderpool_operator.controller.workqueue import WorkQueue


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def test_marks_of_a_waiting_pool_coalesce_into_one_pass() -> None:
    async def main() -> None:
        q: WorkQueue[str] = WorkQueue()
        for _ in range(50):
            q.add("a")
        q.add("b", "resync")
        assert len(q) == 2
        assert await q.get() == ("a", "event")
        assert await q.get() == ("b", "resync")
        assert len(q) == 0

    run(main())


def test_a_pool_marked_during_its_pass_gets_exactly_one_more() -> None:
    async def main() -> None:
        q: WorkQueue[str] = WorkQueue()
        q.add("a")
        key, _ = await q.get()
        q.add("a")
        q.add("a")
        assert len(q) == 0  # not queued while active: never two passes at once
        q.done(key)
        assert len(q) == 1
        assert (await q.get())[0] == "a"
        q.done("a")
        assert len(q) == 0

    run(main())


def test_failures_back_off_doubling_up_to_the_cap_and_reset_when_settled() -> None:
    async def main() -> None:
        q: WorkQueue[str] = WorkQueue(base_delay=1.0, max_delay=5.0)
        assert [q.retry("a") for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
        q.settled("a")
        assert q.retry("a") == 1.0
        q.forget("a")

    run(main())


def test_add_after_keeps_the_earliest_mark_and_fires_once() -> None:
    async def main() -> None:
        q: WorkQueue[str] = WorkQueue()
        q.add_after("a", 0.05)
        q.add_after("a", 10.0)  # later: ignored
        q.add_after("b", 10.0)
        q.add_after("b", 0.05)  # earlier: replaces
        got = {(await asyncio.wait_for(q.get(), 2))[0] for _ in range(2)}
        assert got == {"a", "b"}
        q.forget("a")

    run(main())
