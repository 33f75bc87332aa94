"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does it.

Every replica keeps watching (kopf runs standalone, so every cache stays warm); only the
replica holding the Lease runs passes and writes. The rules, client-go's:

- a candidate takes the Lease when it is free or when its record (``resourceVersion``)
  has not changed for ``leaseDurationSeconds`` *by the candidate's own clock*, counted
  from when the candidate first saw that record (clocks of two machines never compared);
- every write to the Lease is a PUT guarded by the ``resourceVersion`` read: of two
  candidates only one wins, the other gets 409;
- the holder renews every ``retry`` seconds and is the leader only until
  ``renew_deadline`` after the start of its last successful renewal. That is measured
  before the API server stamped the record, so before any other replica saw it: with
  ``renew_deadline < lease_duration`` a holder that cannot renew has stopped writing
  ``lease_duration - renew_deadline`` seconds before anyone else may take over.

``GuardedKube`` makes that a property of the client, not of the callers: every write but
the Lease's own checks ``Elector.leading`` first, so a pass still running when the
lease runs out fails at its next write instead of racing the next holder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

from encoderpool_operator.kube import Kube, KubeError

log = logging.getLogger("encoderpool_operator")

LEASE_API = "coordination.k8s.io/v1"
LEASE_REQUEST_TIMEOUT = (2.0, 4.0)  # (connect, read) seconds: a hung renewal ends in time


class NotLeading(RuntimeError):
    """A write refused because this replica does not hold the Lease (or no longer)."""


@dataclass(frozen=True)
class Timing:
    """client-go's defaults (15 s, 10 s, 2 s): a dead leader is replaced within ~15-17 s,
    and a leader cut off from the API server stops 5 s before anyone may take over."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs retry < renew deadline < lease duration "
                f"(got {self.retry}, {self.renew_deadline}, {self.lease_duration})"
            )


class Conflict(Exception):
    """Another replica wrote the Lease first (409)."""


class Leases(Protocol):
    """The three calls the election makes on its one Lease (named ``name``)."""

    name: str

    def get(self) -> dict[str, Any] | None: ...
    def create(self, lease: dict[str, Any]) -> dict[str, Any]: ...
    def replace(self, lease: dict[str, Any]) -> dict[str, Any]: ...


class KubeLeases:
    """``Leases`` on the API server: GET, POST, and PUT guarded by ``resourceVersion``."""

    def __init__(self, kube: Kube, namespace: str, name: str) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.collection = f"/apis/{LEASE_API}/namespaces/{namespace}/leases"

    def get(self) -> dict[str, Any] | None:
        try:
            out: dict[str, Any] = self.kube.request(
                "GET", f"{self.collection}/{self.name}", kind="Lease"
            )
        except KubeError as e:
            if e.status == 404:
                return None
            raise
        return out

    def _write(self, method: str, path: str, lease: dict[str, Any]) -> dict[str, Any]:
        try:
            out: dict[str, Any] = self.kube.request(method, path, body=lease, kind="Lease")
        except KubeError as e:
            if e.status == 409:
                raise Conflict(str(e)) from e
            raise
        return out

    def create(self, lease: dict[str, Any]) -> dict[str, Any]:
        return self._write("POST", self.collection, lease)

    def replace(self, lease: dict[str, Any]) -> dict[str, Any]:
        return self._write("PUT", f"{self.collection}/{self.name}", lease)


def identity() -> str:
    """Unique per process, as client-go's ``hostname_uuid``: a restarted container with
    its pod's name must not take the record of its previous life for its own."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _micro_time(when: datetime) -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds, UTC)."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    """One replica's side of the election. ``round`` is one attempt (blocking: run it in
    a thread); ``run`` repeats it every ``timing.retry`` seconds and calls back on
    changes; ``leading`` is cheap and thread-safe (a float compared with the clock), for
    every write to check.

    ``clock`` is monotonic seconds (never the wall clock: a clock step must not extend a
    lease); ``wall`` only stamps the record's times for people reading it.
    """

    def __init__(
        self,
        leases: Leases,
        holder: str,
        timing: Timing = Timing(),
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        on_started: Callable[[], None] = lambda: None,
        on_stopped: Callable[[], None] = lambda: None,
    ) -> None:
        self.leases, self.identity, self.timing = leases, holder, timing
        self.clock, self.wall = clock, wall
        self.on_started, self.on_stopped = on_started, on_stopped
        self._until = float("-inf")  # leading while clock() < this
        self._seen: tuple[str, float] | None = None  # (resourceVersion, when first seen)
        self._was_leading = False

    def leading(self) -> bool:
        return self.clock() < self._until

    def _spec(self, previous: dict[str, Any] | None) -> dict[str, Any]:
        now = _micro_time(self.wall())
        old = (previous or {}).get("spec") or {}
        ours = old.get("holderIdentity") == self.identity
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.timing.lease_duration),
            "acquireTime": old.get("acquireTime", now) if ours else now,
            "renewTime": now,
            "leaseTransitions": int(old.get("leaseTransitions") or 0) + (0 if ours else 1),
        }

    def round(self) -> bool:
        """One attempt to acquire or renew; whether this replica leads afterwards."""
        started = self.clock()  # before the request: the record is stamped after this
        try:
            lease = self.leases.get()
            if lease is None:
                spec = self._spec(None)
                spec["leaseTransitions"] = 0
                body = {
                    "apiVersion": LEASE_API,
                    "kind": "Lease",
                    "metadata": {"name": self.leases.name},
                    "spec": spec,
                }
                written = self.leases.create(body)
            else:
                meta, spec = lease.get("metadata") or {}, lease.get("spec") or {}
                version = str(meta.get("resourceVersion", ""))
                if self._seen is None or self._seen[0] != version:
                    self._seen = (version, self.clock())  # a new record: its expiry restarts
                holder = spec.get("holderIdentity")
                duration = float(spec.get("leaseDurationSeconds") or self.timing.lease_duration)
                if holder and holder != self.identity and self.clock() < self._seen[1] + duration:
                    return self.leading()  # held, and alive as far as we can tell
                guarded = {**meta, "resourceVersion": version}  # optimistic concurrency
                written = self.leases.replace(
                    {**lease, "metadata": guarded, "spec": self._spec(lease)}
                )
        except Conflict:
            return self.leading()  # another replica wrote first; its record, next round
        except Exception as e:  # the API server: the deadline decides, the next round retries
            log.warning("leader election: lease not renewed: %s", e)
            return self.leading()
        self._seen = (str((written.get("metadata") or {}).get("resourceVersion", "")), self.clock())
        self._until = started + self.timing.renew_deadline
        return self.leading()

    def settle(self) -> bool:
        """Say (and call back) when leadership started or stopped; in the event loop,
        so the callbacks may touch the work queue."""
        leading = self.leading()
        if leading != self._was_leading:
            self._was_leading = leading
            log.info(
                "leader election: %s %s",
                self.identity,
                "leads: acquired the lease" if leading else "stopped leading",
            )
            (self.on_started if leading else self.on_stopped)()
        return leading

    async def run(self) -> None:
        """Rounds every ``retry`` seconds; also notices, between rounds, a deadline passed."""
        loop = asyncio.get_running_loop()
        while True:
            await loop.run_in_executor(None, self.round)
            self.settle()
            deadline = self.clock() + self.timing.retry
            while (left := deadline - self.clock()) > 0:
                await asyncio.sleep(min(left, 0.5))
                self.settle()

    def release(self) -> None:
        """On a clean shutdown: stop leading, then free the Lease so a peer need not wait
        out its duration (client-go's ReleaseOnCancel). Best effort."""
        if not self.leading():
            return
        self._until = float("-inf")
        self.settle()
        try:
            lease = self.leases.get()
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                spec = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1}
                self.leases.replace({**lease, "spec": spec})
        except Exception as e:
            log.warning("leader election: lease not released: %s", e)


class GuardedKube(Kube):
    """A ``Kube`` whose every write, but the Lease's own, needs ``may_write()`` true."""

    def for_lease(self) -> Kube:
        """A client on the same connection for the election alone: outside the passes'
        rate limit and request counts (a renewal must not queue behind a burst of
        writes), with timeouts short beside the renew deadline."""
        return Kube(self._api, self.field_manager, timeout=LEASE_REQUEST_TIMEOUT)

    may_write: Callable[[], bool] = staticmethod(lambda: True)
    holder = ""  # this replica's identity, for the debug log of writes

    def request(self, method: str, url_path: str, *args: Any, **kwargs: Any) -> Any:
        if method != "GET" and kwargs.get("kind") != "Lease":
            if not self.may_write():
                raise NotLeading(f"{method} {url_path}: this replica does not hold the lease")
            # One line per write, wall time included: tests check no two replicas interleave.
            log.debug("write by %s at %.3f: %s %s", self.holder, time.time(), method, url_path)
        return super().request(method, url_path, *args, **kwargs)
