"""The consumer-side bookkeeping both schedulers share: one lookup per item, and its requests.

vLLM asks ``ensure_cache_available`` for a request until it says yes, then
``has_cache_item`` per item (a yes is final: vLLM skips the encoder), then
``update_state_after_alloc`` per item it scheduled, and ``request_finished``.
A transport decides how one item is looked up (``_start``, ``_advance``);
this base keeps which items are being looked up, which requests wait on
each, and which requests' loads failed.

A step that schedules nothing while lookups are in flight waits for the first
of them (``wait_if_idle``, at most ``IDLE_STEP_WAIT_S``). vLLM would step again
after 1 ms, and every step, empty or not, wakes each tensor-parallel worker,
which then spins for a second: a consumer waiting on a pull kept its engine core
and both TP=2 ranks busy, and on a two-core host that starved the producer's
side channel and READ progress it was waiting for (pulls timed out at 10-20 s;
with the wait they took 0.15-1.5 s).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from vllm.v1.request import Request


class Lookup(Protocol):
    """One item being looked up; ``state`` ends as ``"hit"`` or ``"miss"``."""

    @property
    def state(self) -> str: ...

    @property
    def requests(self) -> set[str]:
        """The requests waiting on this item."""

    @property
    def future(self) -> Future[Any] | None:
        """The answer being worked out off the engine loop, while the lookup is in flight."""


L = TypeVar("L", bound=Lookup)

IDLE_STEP_WAIT_S = 0.02
"""The longest an empty step waits for an in-flight lookup: what a request arriving
meanwhile may wait before it is scheduled."""


class LookupScheduler(ABC, Generic[L]):
    """Per-item lookups of a consumer's scheduler side."""

    in_flight: ClassVar[str]
    """The state of a lookup whose answer is still pending (it outlives its requests)."""

    def __init__(self) -> None:
        self._lookups: dict[str, L] = {}
        self._allocated: dict[str, set[int]] = defaultdict(set)
        self._unavailable: set[str] = set()

    @abstractmethod
    def _start(self, request: Request, index: int) -> L:
        """Begin the lookup of item ``index`` of ``request`` (counted, never raising)."""

    @abstractmethod
    def _advance(self, mm_hash: str, lookup: L) -> bool:
        """Move the lookup on if it can; True once it is decided (hit or miss)."""

    @abstractmethod
    def _forget(self, mm_hash: str) -> None:
        """Drop a lookup nobody needs any more, releasing what it holds."""

    def _consumer_lookups(self, request: Request, num_computed_tokens: int) -> bool:
        """Start or advance the lookup of each item still ahead; False defers the request."""
        ready = True
        done = self._allocated.get(request.request_id, ())
        for index, feature in enumerate(request.mm_features):
            pos = feature.mm_position
            if index in done or pos.offset + pos.length <= num_computed_tokens:
                continue
            lookup = self._lookups.get(feature.identifier)
            if lookup is None:
                lookup = self._start(request, index)
                self._lookups[feature.identifier] = lookup
            lookup.requests.add(request.request_id)
            if not self._advance(feature.identifier, lookup):
                ready = False
        return ready

    def wait_if_idle(self, scheduler_output: Any) -> None:
        """When this step schedules no token, wait for the first in-flight lookup to be
        answered, up to ``IDLE_STEP_WAIT_S``, instead of letting the engine spin."""
        if getattr(scheduler_output, "total_num_scheduled_tokens", None) != 0:
            return
        pending = [
            lk.future
            for lk in self._lookups.values()
            if lk.state == self.in_flight and lk.future is not None
        ]
        if pending:
            wait(pending, timeout=IDLE_STEP_WAIT_S, return_when=FIRST_COMPLETED)

    def has_cache_item(self, identifier: str) -> bool:
        lookup = self._lookups.get(identifier)
        return lookup is not None and lookup.state == "hit"

    def _allocated_hit(self, request: Request, index: int) -> L | None:
        """Record that vLLM scheduled item ``index``; its lookup if that was a hit (to load)."""
        self._allocated[request.request_id].add(index)
        lookup = self._lookups.pop(request.mm_features[index].identifier, None)
        return lookup if lookup is not None and lookup.state == "hit" else None

    def _finish_lookups(self, request: Request) -> None:
        """The request is done: it waits on no lookup; lookups left without requests go."""
        rid = request.request_id
        self._allocated.pop(rid, None)
        for feature in request.mm_features:
            lookup = self._lookups.get(feature.identifier)
            if lookup is not None:
                lookup.requests.discard(rid)
                if not lookup.requests and lookup.state != self.in_flight:
                    self._forget(feature.identifier)

    def _drop_orphans(self) -> None:
        """Forget lookups whose requests all finished while they were in flight, once decided."""
        for mm_hash in [h for h, lk in self._lookups.items() if not lk.requests]:
            lookup = self._lookups[mm_hash]
            if lookup.state == self.in_flight and not self._advance(mm_hash, lookup):
                continue
            self._forget(mm_hash)

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out


def short(mm_hash: str) -> str:
    """An mm_hash fit for a log line: client uuids can be anything, so repr and cut."""
    return repr(mm_hash[:80])
