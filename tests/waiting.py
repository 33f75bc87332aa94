"""One way to wait in tests: poll a condition until it holds, fail naming what was awaited.

``wait_until`` for plain tests, ``async_wait_until`` inside async scenarios
(it sleeps with asyncio, so the servers the scenario runs keep serving).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def _timed_out(what: str, timeout: float, last: Any) -> AssertionError:
    return AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def wait_until(
    what: str, ok: Callable[[], Any], timeout: float = 90.0, interval: float = 0.5
) -> Any:
    """Poll ``ok`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        last = ok()
        if last:
            return last
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, last)
        time.sleep(interval)


async def async_wait_until(
    what: str, ok: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02
) -> Any:
    """``wait_until`` for coroutines: the event loop runs while it waits."""
    deadline = time.monotonic() + timeout
    while True:
        last = ok()
        if last:
            return last
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, last)
        await asyncio.sleep(interval)
