"""kopf wiring: thin adapters from kopf's triggers to ``reconcile.reconcile``.

The pool's own changes, its children's events and a periodic resync all run
the same level-triggered pass; a per-pool lock keeps two passes from
interleaving. Run with ``kopf run -m encoderpool_operator.handlers``.

No handler here needs a finalizer (kopf adds one for timers, daemons and
deletion handlers; children go with the pool through owner references), so a
pool or its namespace deletes even while the operator is stopped. The resync is
therefore one loop over the pools the watch has seen, not a kopf timer; kopf
removes the finalizer an older operator left on a pool.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any

import kopf

from encoderpool_operator import render
from encoderpool_operator.api import GROUP, PLURAL, READY, VERSION
from encoderpool_operator.conditions import PROBLEM_REASONS, find_condition
from encoderpool_operator.kube import Kube
from encoderpool_operator.metrics import OperatorMetrics
from encoderpool_operator.reconcile import invalid_status, reconcile, write_status
from encoderpool_operator.settings import OperatorSettings

_CHILD_LABELS = {"app.kubernetes.io/managed-by": render.MANAGED_BY}
_SETTINGS = OperatorSettings()  # read once, at start-up
METRICS = OperatorMetrics()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """All kopf settings in one place; the API client and locks live in ``memo``."""
    from kubernetes import client, config

    ours = _SETTINGS
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.posting.level = logging.INFO
    if not settings.peering.standalone and settings.peering.priority == 0:
        # Replicas of one Deployment would tie at the default priority, and kopf pauses
        # every peer on a tie: a random priority makes one replica active, the rest standby.
        settings.peering.priority = 1 + secrets.randbelow(2**31 - 1)
    if not settings.peering.clusterwide:
        # Namespaced (--namespace): need no cluster-scoped permission. The namespaces are
        # taken as given and CRDs are not watched (the chart installs the CRD first).
        settings.scanning.disabled = True
    if ours.kubeconfig:
        api = config.new_client_from_config(config_file=ours.kubeconfig)
    else:
        config.load_incluster_config()
        api = client.ApiClient()
    memo.kube = Kube(api)
    METRICS.kube = memo.kube
    if ours.metrics_port:
        METRICS.serve(ours.metrics_port, ours.metrics_address)
    memo.defaults = render.Defaults(
        router_image=ours.router_image, width_retry_seconds=ours.width_retry_seconds
    )
    memo.locks = defaultdict(threading.Lock)
    memo.pools = set()  # (namespace, name) of every pool the watch has seen, for the resync


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Every ``resync_seconds``, one pass per known pool: drift, missed events, back-offs.
    The task lives as long as kopf's loop (cancelled when the operator stops)."""
    memo.resync_task = asyncio.create_task(_resync_loop(memo, logger))


async def _resync_loop(memo: kopf.Memo, logger: Any) -> None:
    while True:
        await asyncio.sleep(_SETTINGS.resync_seconds)
        for namespace, name in sorted(memo.pools):
            owner = {"metadata": {"namespace": namespace, "name": name}}
            try:  # to_thread carries kopf's context (its event poster) into the thread
                await asyncio.to_thread(_pass, owner, memo, logger, False, "resync")
            except kopf.PermanentError:
                pass  # an invalid spec: its status already says why
            except Exception:
                logger.exception("resync of %s/%s failed; the next resync retries", namespace, name)
        logger.info("resync done: %d pools", len(memo.pools))


def _pass(
    body: kopf.Body | dict[str, Any], memo: kopf.Memo, logger: Any, requeue: bool, trigger: str
) -> None:
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    now = datetime.now(timezone.utc)
    started = time.monotonic()
    with memo.locks[key]:
        # Children's events carry a stale copy: read the pool afresh.
        pool = memo.kube.get(f"{GROUP}/{VERSION}", "EncoderPool", *key)
        if pool is None or pool["metadata"].get("deletionTimestamp"):
            METRICS.set_ready(*key, None)
            return
        try:
            outcome = reconcile(memo.kube, pool, memo.defaults, now)
        except ValueError as e:
            status = invalid_status(pool, str(e), now)
            write_status(memo.kube, *key, pool.get("status") or {}, status)
            kopf.warn(pool, reason="InvalidSpec", message=str(e))
            METRICS.passes.labels(trigger, "invalid").inc()
            METRICS.set_ready(*key, "False")
            raise kopf.PermanentError(str(e)) from None
        except Exception:
            METRICS.passes.labels(trigger, "error").inc()
            raise
        finally:
            METRICS.seconds.observe(time.monotonic() - started)
    ready = find_condition(outcome.status.conditions, READY)
    METRICS.set_ready(*key, ready.status if ready else "Unknown")
    METRICS.passes.labels(trigger, "settled" if outcome.requeue_after is None else "waiting").inc()
    for type_, reason, message in outcome.transitions:
        post = kopf.warn if reason in PROBLEM_REASONS else kopf.info
        post(pool, reason=reason, message=f"{type_}: {message}")
    if outcome.applied:
        logger.info("applied %s", ", ".join(outcome.applied))
    if requeue and outcome.requeue_after is not None:
        raise kopf.TemporaryError("waiting", delay=outcome.requeue_after)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def pool_changed(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    _pass(body, memo, logger, requeue=True, trigger="pool")


@kopf.on.event(GROUP, VERSION, PLURAL)
def pool_seen(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Keep the set of pools the resync visits (no pass here: create/update/resume do that)."""
    meta = event["object"].get("metadata", {})
    key = (meta.get("namespace", ""), meta.get("name", ""))
    if event["type"] == "DELETED":
        memo.pools.discard(key)
        memo.locks.pop(key, None)
    else:
        memo.pools.add(key)


@kopf.on.event("apps", "v1", "deployments", labels=_CHILD_LABELS)
@kopf.on.event("batch", "v1", "jobs", labels=_CHILD_LABELS)
def child_changed(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """A child moved (rollout progress, Job finished): reconcile its pool."""
    labels = body.get("metadata", {}).get("labels", {})
    pool = labels.get(render.LABEL_POOL)
    if pool:
        owner = {"metadata": {"namespace": body["metadata"]["namespace"], "name": pool}}
        _pass(owner, memo, logger, requeue=False, trigger="child")
