"""Whether kopf has paused this replica for a peer, so that our own loops pause too.

kopf pauses its watches while a live peer has a higher priority (or the same one:
then every tied peer pauses). The resync and the workers are ours, not kopf's: a
paused replica's cache stops updating, and a pass run from it would write from a
stale view, against the active replica's writes. kopf does not expose its pause
flag, so a task reads the peering object kopf keeps alive (a LIST by name: the
chart's RBAC has no ``get`` on it) and applies kopf's own rule to its status.

Both the object's shape (``status``: identity -> priority, lifetime, lastseen) and
the rule are kopf's internals, not its API: tests/operator/test_peering.py runs
kopf's own peering code on the same statuses and fails when they part.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from encoderpool_operator.kube import Kube

log = logging.getLogger("encoderpool_operator")

PEERING_API = "/apis/kopf.dev/v1"
DEFAULT_LIFETIME = 60  # kopf's default when a peer does not say


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def outranked(
    status: Mapping[str, Any], *, identity: str | None, priority: int, now: datetime
) -> bool:
    """kopf's rule: paused while another live peer has a priority >= ours.

    ``status`` maps each peer's identity to ``{priority, lifetime, lastseen}``. Our own
    entry is the one under ``identity``; when the identity is unknown (kopf makes up a
    random one outside a pod) it is one entry of our priority, as priorities are random.
    A peer whose ``lastseen + lifetime`` has passed is dead and does not count.
    """
    same = 0
    for peer, info in status.items():
        if peer == identity or not isinstance(info, Mapping):
            continue
        seen = _parse_time(info.get("lastseen"))
        try:
            lifetime = int(info.get("lifetime", DEFAULT_LIFETIME))
            theirs = int(info.get("priority", 0))
        except (TypeError, ValueError):
            continue
        if seen is None or seen + timedelta(seconds=lifetime) <= now:
            continue
        if theirs > priority:
            return True
        same += theirs == priority
    return same > (0 if identity is not None else 1)


def peering_path(name: str, namespace: str | None) -> str:
    """The LIST of kopf's peering objects narrowed to one name (cluster-wide or namespaced)."""
    if namespace:
        return f"{PEERING_API}/namespaces/{namespace}/kopfpeerings"
    return f"{PEERING_API}/clusterkopfpeerings"


@dataclass(frozen=True)
class Peer:
    """This replica as kopf's peering knows it."""

    name: str  # the peering object's (kopf's --peering)
    namespace: str | None  # the object's namespace; None: cluster-wide
    identity: str | None  # kopf's identity for it (POD_ID in a pod; else made up, unknown)
    priority: int


def pod_namespace() -> str:
    """The namespace this pod runs in (its service account's)."""
    with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
        return f.read().strip()


class Standby:
    """``paused`` follows kopf's pause, polled every ``interval`` seconds.

    A failed read keeps the last answer: an API server that cannot be reached stops
    kopf's watches as well, and the next read decides.
    """

    def __init__(self, kube: Kube, peer: Peer, *, interval: float) -> None:
        self.kube = kube
        self.peer = peer
        self.path = peering_path(peer.name, peer.namespace)
        self.interval = interval
        self.paused = False

    def check(self) -> bool:
        """One read of the peering object; whether this replica is paused now."""
        items = self.kube.request(
            "GET",
            self.path,
            query={"fieldSelector": f"metadata.name={self.peer.name}"},
            kind="KopfPeering (list)",
        )["items"]
        status = items[0].get("status") or {} if items else {}
        now = datetime.now(timezone.utc)
        return outranked(status, identity=self.peer.identity, priority=self.peer.priority, now=now)

    def set(self, paused: bool) -> None:
        if paused != self.paused:
            log.info("peering: %s", "standby (a peer outranks us)" if paused else "active")
        self.paused = paused

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                self.set(await loop.run_in_executor(None, self.check))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the last answer stands; the next read decides
                log.warning("peering: could not read %s: %s", self.path, e)
            await asyncio.sleep(self.interval)
