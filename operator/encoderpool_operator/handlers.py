"""kopf wiring: watches fill a read cache and mark pools; workers run the passes.

    kopf indexes        every object of the kinds a pass reads -> cache.Cache
    kopf event handlers a pool or one of its children changed  -> mark the pool
    resync              every resync_seconds                    -> mark every pool
    workers (N tasks)   take a marked pool -> reconcile.reconcile in a thread

A pool marked many times while it waits gets one pass; a pool never has two
passes at once (``workqueue.WorkQueue``). A pass reads the cache, not the API
server, and writes only what differs. Run with
``kopf run -m encoderpool_operator.handlers``.

No handler here is a kopf change handler, a timer or a daemon, so kopf keeps no
state on the pools (no annotations, no finalizer: a pool or its namespace deletes
even while the operator is stopped; kopf drops the finalizer an older operator
left) and a pass with nothing to do writes nothing at all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import kopf

from encoderpool_operator import events, render
from encoderpool_operator.api import API_VERSION, GROUP, KIND, PLURAL, READY, VERSION
from encoderpool_operator.cache import (
    Cache,
    Packed,
    PassView,
    PoolKey,
    index_entries,
    pack,
    trim,
)
from encoderpool_operator.conditions import PROBLEM_REASONS, find_condition
from encoderpool_operator.kube import PLURALS, Kube, RateLimiter
from encoderpool_operator.metrics import OperatorMetrics
from encoderpool_operator.peering import Standby
from encoderpool_operator.reconcile import invalid_status, reconcile, write_status
from encoderpool_operator.settings import OperatorSettings
from encoderpool_operator.workqueue import WorkQueue

log = logging.getLogger("encoderpool_operator")
_SETTINGS = OperatorSettings()  # read once, at start-up
METRICS = OperatorMetrics()
_CHILD_LABELS = {render.LABEL_MANAGED_BY: render.MANAGED_BY}
# What a pass reads, cached: the pool's children, its width Jobs, the report ConfigMaps.
CACHED_KINDS: tuple[tuple[str, str], ...] = (
    *render.CHILD_KINDS,
    ("batch/v1", "Job"),
    ("v1", "ConfigMap"),
)


def _index_id(api_version: str, kind: str) -> str:
    return "cache_" + PLURALS[(api_version, kind)]


def _resource(api_version: str, kind: str) -> tuple[str, str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version, PLURALS[(api_version, kind)]


def _register_cache(api_version: str, kind: str) -> None:
    """One kopf index per cached kind (every object), one mark handler (our children)."""

    def entries(body: kopf.Body, **kwargs: Any) -> dict[tuple[str, str, str], Packed]:
        index = kwargs.get(_index_id(api_version, kind))  # this kind's, as it is now
        siblings = None if index is None else lambda key: index.get(key) or ()
        return index_entries(dict(body), api_version, kind, siblings)

    async def changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        meta = body.get("metadata", {})
        pool = meta.get("labels", {}).get(render.LABEL_POOL)
        if pool:  # coalesced: a rollout is a burst of status changes
            memo.queue.add_after((meta.get("namespace", ""), pool), _SETTINGS.settle_seconds)

    group, version, plural = _resource(api_version, kind)
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
    """Mark the pool: at once for a new spec, coalesced for anything else (a status write)."""
    obj = event["object"]
    meta = obj.get("metadata", {})
    key = (meta.get("namespace", ""), meta.get("name", ""))
    if event["type"] == "DELETED":
        memo.pools.discard(key)
        memo.status_written.pop(key, None)
        memo.queue.forget(key)
        memo.cache.overlay.forget(key)
        METRICS.set_ready(*key, None)
        return
    memo.pools.add(key)
    if meta.get("generation") != (obj.get("status") or {}).get("observedGeneration"):
        memo.queue.add(key)
    else:
        memo.queue.add_after(key, _SETTINGS.settle_seconds, "event")


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    """All kopf settings in one place; the API client, cache, queue and workers in ``memo``."""
    from kubernetes import client, config

    ours = _SETTINGS
    # The name an operator before 0.2 gave its finalizer: kopf removes it from pools,
    # as no handler here needs one.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # kopf keeps a task per object for this long after its last event: 1 s instead of 5
    # (a pool's creation touches 16 objects; at 1,000 pools the lingering tasks were a
    # large part of the peak RSS). Not worker_limit: a capped pool of per-object tasks
    # can deadlock on kopf's wait for every index to fill.
    settings.batching.idle_timeout = 1.0
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.posting.enabled = False  # passes post their own Events (events.py)
    # kopf logs every index update and event handler at INFO: the passes' own log
    # (the "encoderpool_operator" logger) says what matters.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if not settings.peering.standalone and settings.peering.priority == 0:
        # Replicas of one Deployment would tie at the default priority, and kopf pauses
        # every peer on a tie: a random priority makes one replica active, the rest standby.
        settings.peering.priority = 1 + secrets.randbelow(2**31 - 1)
    if not settings.peering.clusterwide:
        # Namespaced (--namespace): need no cluster-scoped permission. The namespaces are
        # taken as given and CRDs are not watched (the chart installs the CRD first).
        settings.scanning.disabled = True
    cfg = client.Configuration()
    if ours.kubeconfig:
        config.load_kube_config(config_file=ours.kubeconfig, client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = ours.max_connections  # one per concurrent request
    api = client.ApiClient(cfg)
    memo.kube = Kube(api, limiter=RateLimiter(ours.api_qps, ours.api_burst))
    METRICS.kube = memo.kube
    if ours.metrics_port:
        METRICS.serve(ours.metrics_port, ours.metrics_address)
    memo.defaults = render.Defaults(
        router_image=ours.router_image, width_retry_seconds=ours.width_retry_seconds
    )
    indexes = {kind: kwargs[_index_id(*kind)] for kind in CACHED_KINDS}
    memo.cache = Cache(indexes, kwargs["cache_pools"])
    memo.queue = WorkQueue(base_delay=1.0, max_delay=ours.max_retry_seconds)
    METRICS.queue = memo.queue
    memo.pools = set()  # (namespace, name) of every pool the watch has seen, for the resync
    memo.status_written = {}  # (namespace, name) -> when a pass last wrote its status
    memo.writes = ThreadPoolExecutor(ours.write_concurrency, thread_name_prefix="write")
    memo.passes = ThreadPoolExecutor(ours.workers, thread_name_prefix="pass")
    loop = asyncio.get_running_loop()
    memo.tasks = [loop.create_task(_worker(memo)) for _ in range(ours.workers)]
    memo.tasks.append(loop.create_task(_resync(memo)))
    memo.standby = None
    if not settings.peering.standalone:
        memo.standby = Standby(
            memo.kube,
            name=settings.peering.name,
            namespace=None if settings.peering.clusterwide else _peering_namespace(),
            identity=os.environ.get("POD_ID"),  # kopf's identity in a pod
            priority=settings.peering.priority,
            interval=ours.peering_check_seconds,
        )
        memo.tasks.append(loop.create_task(memo.standby.run()))


def _peering_namespace() -> str:
    """The namespace of a namespaced operator's KopfPeering: the setting, else the pod's."""
    if _SETTINGS.peering_namespace:
        return _SETTINGS.peering_namespace
    with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
        return f.read().strip()


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    for task in memo.get("tasks", ()):
        task.cancel()
    for pool in ("passes", "writes"):
        if pool in memo:
            memo[pool].shutdown(wait=False, cancel_futures=True)


async def _resync(memo: kopf.Memo) -> None:
    """Every ``resync_seconds``, mark every pool: drift, missed events, back-offs."""
    while True:
        await asyncio.sleep(_SETTINGS.resync_seconds)
        if _standby(memo):
            log.info("resync: standby, %d pools left to the active replica", len(memo.pools))
            continue
        for key in sorted(memo.pools):
            memo.queue.add(key, "resync")
        log.info("resync: %d pools marked", len(memo.pools))


def _standby(memo: kopf.Memo) -> bool:
    """A peer outranks this replica: kopf paused its watches, our loops pause too."""
    standby: Standby | None = memo.get("standby")
    return standby is not None and standby.paused


async def _worker(memo: kopf.Memo) -> None:
    while True:
        key, why = await memo.queue.get()
        try:
            delay = await _pass(key, why, memo)
        except asyncio.CancelledError:
            raise
        except Exception:
            retry = memo.queue.retry(key)
            log.exception("pass of %s/%s failed; retrying in %.0fs", *key, retry)
        else:
            memo.queue.settled(key)
            if delay is not None:
                memo.queue.add_after(key, delay)
        finally:
            memo.queue.done(key)


async def _pass(key: PoolKey, why: str, memo: kopf.Memo) -> float | None:
    """One pass of pool ``key``; the delay after which to look again, if any."""
    if _standby(memo):
        # kopf paused our watches, so the cache is stale; once resumed, its fresh
        # listing marks every pool again.
        return None
    packed = memo.cache.pool(key)
    pool = packed.unpack() if packed else None
    if pool is None or pool["metadata"].get("deletionTimestamp"):
        METRICS.set_ready(*key, None)
        return None
    view = PassView(
        memo.cache, asyncio.get_running_loop(), key, memo.kube, pool["metadata"].get("uid")
    )
    view.served[(API_VERSION, KIND, key[1])] = packed.resource_version
    return await view.loop.run_in_executor(memo.passes, _run, pool, view, why, memo)


def _run(pool: Mapping[str, Any], view: PassView, why: str, memo: kopf.Memo) -> float | None:
    namespace, name = view.pool_key
    now = datetime.now(timezone.utc)
    started = time.monotonic()
    try:
        outcome = reconcile(
            memo.kube,
            pool,
            memo.defaults,
            now,
            view,
            memo.writes,
            view.record,
            memo.status_written.get(view.pool_key),
        )
    except ValueError as e:
        status = invalid_status(pool, str(e), now)
        if written := write_status(memo.kube, namespace, name, pool.get("status") or {}, status):
            view.record((API_VERSION, KIND, name), written)
            events.post(memo.kube, pool, "Warning", "InvalidSpec", str(e))
        METRICS.passes.labels(why, "invalid").inc()
        METRICS.set_ready(namespace, name, "False")
        return None  # until the spec changes (its event marks the pool)
    except Exception:
        METRICS.passes.labels(why, "error").inc()
        raise
    finally:
        METRICS.seconds.observe(time.monotonic() - started)
    if outcome.wrote_status:
        memo.status_written[view.pool_key] = now
    ready = find_condition(outcome.status.conditions, READY)
    METRICS.set_ready(namespace, name, ready.status if ready else "Unknown")
    METRICS.passes.labels(why, "settled" if outcome.requeue_after is None else "waiting").inc()
    was_ready = any(
        c.get("type") == READY and c.get("status") == "True"
        for c in (pool.get("status") or {}).get("conditions", [])
    )
    for type_, reason, message in outcome.transitions:
        if reason in PROBLEM_REASONS:
            events.post(memo.kube, pool, "Warning", reason, f"{type_}: {message}")
        elif type_ == READY and was_ready:
            # Ready is the normal state: leaving it is news, reaching it is in the status.
            events.post(memo.kube, pool, "Normal", reason, f"{type_}: {message}")
    if outcome.applied:
        log.info("%s/%s: applied %s", namespace, name, ", ".join(outcome.applied))
    return outcome.requeue_after
