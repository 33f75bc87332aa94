"""The router's backends: who they are, and how each call to one is accounted for.

A role's backends are a ``BackendSet`` (the consumers; the producers, or one set per
producer group), filled from flags or from EndpointSlices (``discovery``). ``Calls``
is the one place a backend's in-flight count and its ejection change, for producers
and consumers alike: a call that finds the backend down ejects it for ``--eject-s``,
``usable`` passes it over until then, and it is back after.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import Gauge, Histogram

from encoderpool_router.config import GROUP_MODALITIES, RouterSettings
from encoderpool_router.upstream import UpstreamError

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Backend:
    """One producer or consumer; its counts survive EndpointSlice updates and change
    only through ``Calls.track``."""

    url: str
    in_flight: int = 0
    ejected_until: float = 0.0  # time.monotonic() until which it is passed over

    def __repr__(self) -> str:
        return f"Backend({self.url}, in_flight={self.in_flight})"


def usable(backends: Sequence[Backend], now: float | None = None) -> list[Backend]:
    """The backends not ejected after a failure; all of them if every one was ejected."""
    t = time.monotonic() if now is None else now
    fine = [b for b in backends if b.ejected_until <= t]
    return fine or list(backends)


class Calls:
    """The bookkeeping of the calls to one role's backends (producers or consumers).

    While a call runs its backend counts it in flight (``Backend.in_flight``, what the
    policies balance on) and so does the role's gauge; its time is observed when it
    ends, however it ends. A call that fails with an ``UpstreamError`` has its kind
    counted and, when the error says the backend looks down, ejects the backend for
    ``eject_s``.
    """

    def __init__(
        self,
        eject_s: float,
        in_flight: Gauge,
        latency: Histogram,
        count_error: Callable[[str], None],
    ) -> None:
        self.eject_s = eject_s
        self._in_flight = in_flight
        self._latency = latency
        self._count_error = count_error

    @contextmanager
    def track(self, backend: Backend) -> Iterator[None]:
        """One call to ``backend`` for the duration of the block."""
        start = time.perf_counter()
        backend.in_flight += 1
        self._in_flight.inc()
        try:
            yield
        except UpstreamError as e:
            self._count_error(e.kind)
            if e.eject:
                backend.ejected_until = time.monotonic() + self.eject_s
            raise
        finally:
            backend.in_flight -= 1
            self._in_flight.dec()
            self._latency.observe(time.perf_counter() - start)


class BackendSet:
    """The current backends of one role (producer or consumer)."""

    def __init__(self, role: str, urls: Iterable[str] = ()) -> None:
        self.role = role
        self._by_url: dict[str, Backend] = {}
        self.listeners: list[Callable[[BackendSet], None]] = []
        self.replace(urls)

    @property
    def backends(self) -> list[Backend]:
        return list(self._by_url.values())

    @property
    def urls(self) -> list[str]:
        return list(self._by_url)

    def __len__(self) -> int:
        return len(self._by_url)

    def replace(self, urls: Iterable[str]) -> None:
        """Make ``urls`` the set; a backend that stays keeps its in-flight count."""
        new = sorted(set(urls))
        if new == list(self._by_url):
            return
        self._by_url = {u: self._by_url.get(u) or Backend(u) for u in new}
        logger.info("%s backends now %s", self.role, new)
        for listener in self.listeners:
            listener(self)


class ProducerGroups:
    """Which producers encode each modality: one set for every modality, or a set per
    producer group (several modalities may share one). A modality without a set is
    encoded by the consumer: the router sends its items to no producer."""

    def __init__(
        self, by_modality: Mapping[str, BackendSet], services: Mapping[str, BackendSet]
    ) -> None:
        self.by_modality = dict(by_modality)  # a modality missing: no producer encodes it
        # Service name -> the set its EndpointSlices fill (empty with static backends).
        self.services = dict(services)

    @property
    def sets(self) -> list[BackendSet]:
        """Each distinct set once, in modality order."""
        out: list[BackendSet] = []
        for target in self.by_modality.values():
            if all(target is not s for s in out):
                out.append(target)
        return out


def producer_groups(settings: RouterSettings, producers: BackendSet) -> ProducerGroups:
    """The routes ``settings`` ask for. Without groups every modality goes to
    ``producers`` (filled from --producers or --producer-service); with groups each
    distinct URL list or Service gets a set of its own, named after its modalities."""
    if not settings.grouped:
        watched = {settings.producer_service: producers} if settings.producer_service else {}
        return ProducerGroups(dict.fromkeys(GROUP_MODALITIES, producers), watched)
    by_source: dict[tuple[str, ...], list[str]] = {}  # URLs or (Service,) -> modalities
    if settings.producers_by_modality:
        sources = dict(settings.producers_by_modality)
    else:
        sources = {m: (svc,) for m, svc in settings.producer_services_by_modality.items()}
    for modality, source in sorted(sources.items()):
        by_source.setdefault(tuple(source), []).append(modality)
    by_modality: dict[str, BackendSet] = {}
    services: dict[str, BackendSet] = {}
    for source, modalities in by_source.items():
        role = "producer-" + "+".join(modalities)
        if settings.producers_by_modality:
            target = BackendSet(role, source)
        else:
            target = BackendSet(role)
            services[source[0]] = target
        by_modality.update(dict.fromkeys(modalities, target))
    return ProducerGroups(by_modality, services)
