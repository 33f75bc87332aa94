"""Which pools need a pass: each queued at most once, never two passes of one pool at once.

Events only mark a pool; workers take pools off the queue. A burst of events for
one pool (its Deployments, Services and status all change during creation) is
one pass, not one per event, and a pool marked while its pass runs gets one more
pass after it (never lost, never concurrent). The queue holds at most one entry
per pool, so it is bounded by the number of pools. Failures back off per pool
(doubling, capped); a pool that settles starts again from the base delay. The
client-go workqueue works the same way. Used only from the event loop's thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    """Keys (pools) waiting for a pass, the ones in a pass, their timers and back-offs."""

    def __init__(self, base_delay: float = 1.0, max_delay: float = 300.0) -> None:
        # Unbounded as a type, bounded in use: a key is put only when not already queued.
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._queued: set[K] = set()
        self._active: set[K] = set()
        self._again: set[K] = set()  # marked while active: one more pass after
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._failures: dict[K, int] = {}
        self._why: dict[K, str] = {}  # what first marked a queued key (for metrics)
        self.base_delay, self.max_delay = base_delay, max_delay

    def add(self, key: K, why: str = "event") -> None:
        """Mark ``key``: it gets a pass soon (once, however often it is marked)."""
        if key in self._active:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._why[key] = why
            self._queue.put_nowait(key)

    def add_after(self, key: K, delay: float, why: str = "requeue") -> None:
        """Mark ``key`` in ``delay`` seconds; an earlier pending mark wins."""
        loop = asyncio.get_running_loop()
        timer = self._timers.get(key)
        if timer is not None:
            if timer.when() <= loop.time() + delay:
                return
            timer.cancel()
        self._timers[key] = loop.call_later(delay, self._fire, key, why)

    def _fire(self, key: K, why: str) -> None:
        self._timers.pop(key, None)
        self.add(key, why)

    def retry(self, key: K) -> float:
        """Mark ``key`` after its next back-off delay (a failed pass); returns the delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = float(min(self.max_delay, self.base_delay * 2**failures))
        self.add_after(key, delay, "retry")
        return delay

    def settled(self, key: K) -> None:
        """A pass of ``key`` succeeded: its next failure backs off from the base again."""
        self._failures.pop(key, None)

    def forget(self, key: K) -> None:
        """``key`` is gone (a deleted pool): drop its timer and failure count."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._failures.pop(key, None)

    async def get(self) -> tuple[K, str]:
        """The next key to pass and what marked it; call ``done(key)`` afterwards."""
        key = await self._queue.get()
        self._queued.discard(key)
        self._active.add(key)
        return key, self._why.pop(key, "event")

    def done(self, key: K) -> None:
        self._active.discard(key)
        if key in self._again:
            self._again.discard(key)
            self.add(key, "event")

    def __len__(self) -> int:
        """Keys waiting (not the ones being passed, nor timers)."""
        return self._queue.qsize()
