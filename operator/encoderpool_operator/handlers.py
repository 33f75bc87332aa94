"""kopf wiring: watches fill the read cache and tell the controller what changed.

    kopf indexes        every object of the kinds a pass reads -> cache.Cache
    kopf event handlers a pool or one of its children changed  -> the controller marks it

The controller (``controller.Controller``) runs the passes. Run with
``kopf run -m encoderpool_operator.handlers``.

No handler here is a kopf change handler, a timer or a daemon, so kopf keeps no
state on the pools (no annotations, no finalizer: a pool or its namespace deletes
even while the operator is stopped) and a pass with nothing to do writes nothing
at all.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from encoderpool_operator.api import API_VERSION, GROUP, KIND, PLURAL, VERSION
from encoderpool_operator.cache import (
    CACHED_KINDS,
    Cache,
    Packed,
    PoolKey,
    index_entries,
    pack,
    trim,
)
from encoderpool_operator.controller import (
    Controller,
    Elector,
    KubeLeases,
    Timing,
    connect,
    identity,
)
from encoderpool_operator.kube import PLURALS
from encoderpool_operator.naming import LABEL_MANAGED_BY, MANAGED_BY
from encoderpool_operator.settings import OperatorSettings

_SETTINGS = OperatorSettings()  # read once, at start-up
_CHILD_LABELS = {LABEL_MANAGED_BY: MANAGED_BY}


def _index_id(api_version: str, kind: str) -> str:
    return "cache_" + PLURALS[(api_version, kind)]


def _register_cache(api_version: str, kind: str) -> None:
    """One kopf index per cached kind (every object), one mark handler (our children)."""

    def entries(body: kopf.Body, **kwargs: Any) -> dict[tuple[str, str, str], Packed]:
        index = kwargs.get(_index_id(api_version, kind))  # this kind's, as it is now
        siblings = None if index is None else lambda key: index.get(key) or ()
        return index_entries(dict(body), api_version, kind, siblings)

    async def changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        memo.controller.child_changed(body.get("metadata", {}))

    group, _, version = api_version.rpartition("/")
    plural = PLURALS[(api_version, kind)]
    kopf.index(group=group, version=version, plural=plural, id=_index_id(api_version, kind))(
        entries
    )
    kopf.on.event(
        group=group, version=version, plural=plural, id=f"mark_{plural}", labels=_CHILD_LABELS
    )(changed)


for _api_version, _kind in CACHED_KINDS:
    _register_cache(_api_version, _kind)


@kopf.index(GROUP, VERSION, PLURAL)
def cache_pools(
    namespace: str | None, name: str, body: kopf.Body, **_: Any
) -> dict[PoolKey, Packed]:
    return {(namespace or "", name): pack(trim(dict(body), API_VERSION, KIND))}


@kopf.on.event(GROUP, VERSION, PLURAL)
async def pool_seen(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    memo.controller.pool_event(event["type"], event["object"])


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    """All kopf settings in one place; the controller, started, in ``memo``."""
    # kopf keeps a task per object for this long after its last event: 1 s instead of 5
    # (a pool's creation touches 16 objects; at 1,000 pools the lingering tasks were a
    # large part of the peak RSS). Not worker_limit: a capped pool of per-object tasks
    # can deadlock on kopf's wait for every index to fill.
    settings.batching.idle_timeout = 1.0
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.posting.enabled = False  # passes post their own Events (controller/events.py)
    # kopf logs every index update and event handler at INFO: the passes' own log
    # (the "encoderpool_operator" logger) says what matters.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # No kopf peering: it would pause a standby's watches, and its cache with them. Every
    # replica watches; the Lease (controller/leader.py) picks the one that writes.
    settings.peering.standalone = True
    if not settings.peering.clusterwide:
        # Namespaced (--namespace): need no cluster-scoped permission. The namespaces are
        # taken as given and CRDs are not watched (the chart installs the CRD first).
        settings.scanning.disabled = True
    kube = connect(_SETTINGS)
    elector = Elector(
        KubeLeases(kube.for_lease(), _SETTINGS.lease_namespace_or_own(), _SETTINGS.lease_name),
        identity(),
        Timing(
            _SETTINGS.lease_duration_seconds,
            _SETTINGS.renew_deadline_seconds,
            _SETTINGS.retry_period_seconds,
        ),
    )
    cache = Cache({kind: kwargs[_index_id(*kind)] for kind in CACHED_KINDS}, kwargs["cache_pools"])
    memo.controller = Controller(_SETTINGS, kube, cache, elector)
    memo.controller.start()


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    if "controller" in memo:
        memo.controller.stop()
