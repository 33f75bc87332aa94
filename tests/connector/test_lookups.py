"""The consumer lookups' wait on an empty step (core.lookups.wait_if_idle), without an
engine: a scheduler of hand-made lookups whose answers the test gives. The real engine
is tests/connector/tp2/test_tp2_rdma.py, whose pulls timed out while the engine spun."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from encoderpool_connector.core import lookups
from encoderpool_connector.core.lookups import LookupScheduler

LONG = 30.0  # the wait bound in these tests: a call that ran into it fails the test


@dataclass
class _Item:
    state: str
    future: Future[Any] | None = None
    requests: set[str] = field(default_factory=set)


class _Scheduler(LookupScheduler[_Item]):
    in_flight = "asking"

    def _start(self, request: Any, index: int) -> _Item:
        raise NotImplementedError

    def _advance(self, mm_hash: str, lookup: _Item) -> bool:
        return lookup.state != self.in_flight

    def _forget(self, mm_hash: str) -> None:
        self._lookups.pop(mm_hash, None)


@pytest.fixture(autouse=True)
def long_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookups, "IDLE_STEP_WAIT_S", LONG)


def step(tokens: int) -> SimpleNamespace:
    return SimpleNamespace(total_num_scheduled_tokens=tokens)


def timed(fn: Any) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def test_an_empty_step_returns_when_the_first_lookup_is_answered() -> None:
    sched = _Scheduler()
    first: Future[Any] = Future()
    never: Future[Any] = Future()
    sched._lookups = {"a": _Item("asking", first), "b": _Item("asking", never)}
    threading.Timer(0.05, first.set_result, args=("answer",)).start()
    assert timed(lambda: sched.wait_if_idle(step(0))) < LONG / 3
    assert first.done()
    assert not never.done()


def test_a_step_that_runs_tokens_never_waits() -> None:
    sched = _Scheduler()
    never: Future[Any] = Future()
    sched._lookups = {"a": _Item("asking", never)}
    assert timed(lambda: sched.wait_if_idle(step(5))) < LONG / 3
    # An output without the count (another vLLM) is treated as busy, never waited on.
    assert timed(lambda: sched.wait_if_idle(SimpleNamespace())) < LONG / 3
    assert not never.done()


def test_an_empty_step_without_lookups_in_flight_does_not_wait() -> None:
    sched = _Scheduler()
    never: Future[Any] = Future()
    # Decided lookups (their future may linger) and one in flight without a future.
    sched._lookups = {"a": _Item("hit", never), "b": _Item("miss"), "c": _Item("asking")}
    assert timed(lambda: sched.wait_if_idle(step(0))) < LONG / 3


def test_the_wait_is_bounded() -> None:
    sched = _Scheduler()
    never: Future[Any] = Future()
    sched._lookups = {"a": _Item("asking", never)}
    lookups.IDLE_STEP_WAIT_S = 0.05  # undone by the fixture
    assert timed(lambda: sched.wait_if_idle(step(0))) >= 0.05
    assert not never.done()
