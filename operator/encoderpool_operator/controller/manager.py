"""The controller: which pools need a pass, and the workers that run the passes.

    kopf watches (handlers.py)  fill the read cache; a change marks its pool
    resync                      every resync_seconds, mark every pool
    workers (N tasks)           take a marked pool -> reconcile.reconcile in a thread

A pool marked many times while it waits gets one pass; a pool never has two
passes at once (``WorkQueue``). A pass reads the cache, not the API server, and
writes only what differs. Every replica keeps watching; only the one holding the
Lease (``leader.Elector``) runs passes, and its client refuses writes once the
lease runs out (``leader.GuardedKube``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from encoderpool_operator.api import API_VERSION, KIND
from encoderpool_operator.cache import Cache, PassView, PoolKey
from encoderpool_operator.controller import events
from encoderpool_operator.controller.leader import Elector, GuardedKube, NotLeading
from encoderpool_operator.controller.metrics import OperatorMetrics
from encoderpool_operator.controller.workqueue import WorkQueue
from encoderpool_operator.kube import Kube, RateLimiter
from encoderpool_operator.naming import LABEL_POOL
from encoderpool_operator.reconcile import invalid_status, reconcile, write_status
from encoderpool_operator.render import Defaults
from encoderpool_operator.settings import OperatorSettings

log = logging.getLogger("encoderpool_operator")


def connect(settings: OperatorSettings) -> GuardedKube:
    """The API client: the kubeconfig the settings name, else the pod's own credentials.
    Its writes wait for the Lease once a ``Controller`` with an elector holds it."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if settings.kubeconfig:
        config.load_kube_config(config_file=settings.kubeconfig, client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = settings.max_connections  # one per concurrent request
    return GuardedKube(
        client.ApiClient(cfg), limiter=RateLimiter(settings.api_qps, settings.api_burst)
    )


class Controller:
    """The work queue, the resync, the workers and what they remember between passes.

    Built and started in the event loop (kopf's startup handler); the kopf
    handlers only tell it what changed (``pool_event``, ``child_changed``).
    """

    def __init__(
        self, settings: OperatorSettings, kube: Kube, cache: Cache, elector: Elector | None
    ) -> None:
        """``elector`` None: this replica always leads (a single process, the tests)."""
        self.settings = settings
        self.kube = kube
        self.cache = cache
        self.defaults = Defaults(
            router_image=settings.router_image,
            width_retry_seconds=settings.width_retry_seconds,
            autoscaling_engine=settings.autoscaling_engine,
            prometheus_address=settings.prometheus_address,
        )
        self.queue: WorkQueue[PoolKey] = WorkQueue(
            base_delay=1.0, max_delay=settings.max_retry_seconds
        )
        self.metrics = OperatorMetrics()
        self.metrics.kube, self.metrics.queue = kube, self.queue
        self.elector = elector
        if elector is not None:
            elector.on_started = self._started_leading
            if isinstance(kube, GuardedKube):
                kube.may_write, kube.holder = elector.leading, elector.identity
        self.pools: set[PoolKey] = set()  # every pool the watch has seen, for the resync
        self.status_written: dict[PoolKey, datetime] = {}  # when a pass last wrote its status
        self._writes = ThreadPoolExecutor(settings.write_concurrency, thread_name_prefix="write")
        self._passes = ThreadPoolExecutor(settings.workers, thread_name_prefix="pass")
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Serve the metrics, start the workers, the resync and the election."""
        if self.settings.metrics_port:
            self.metrics.serve(self.settings.metrics_port, self.settings.metrics_address)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._worker()) for _ in range(self.settings.workers)]
        self._tasks.append(loop.create_task(self._resync()))
        if self.elector is not None:
            self._tasks.append(loop.create_task(self.elector.run()))

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for executor in (self._passes, self._writes):
            executor.shutdown(wait=False, cancel_futures=True)
        if self.elector is not None:
            self.elector.release()  # writes stop first, then a peer may take over at once

    def pool_event(self, event_type: str, obj: Mapping[str, Any]) -> None:
        """Mark the pool: at once for a new spec, coalesced for anything else (a status write)."""
        meta = obj.get("metadata", {})
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if event_type == "DELETED":
            self.pools.discard(key)
            self.status_written.pop(key, None)
            self.queue.forget(key)
            self.cache.overlay.forget(key)
            self.metrics.set_status(*key, None)
            return
        self.pools.add(key)
        if meta.get("generation") != (obj.get("status") or {}).get("observedGeneration"):
            self.queue.add(key)
        else:
            self.queue.add_after(key, self.settings.settle_seconds, "event")

    def child_changed(self, meta: Mapping[str, Any]) -> None:
        """Mark the pool a child names, coalesced: a rollout is a burst of status changes."""
        pool = meta.get("labels", {}).get(LABEL_POOL)
        if pool:
            self.queue.add_after((meta.get("namespace", ""), pool), self.settings.settle_seconds)

    @property
    def paused(self) -> bool:
        """Another replica holds the Lease (or this one's ran out): no passes here."""
        return self.elector is not None and not self.elector.leading()

    def _started_leading(self) -> None:
        """The cache is warm but nothing was reconciled here: mark every pool."""
        for key in sorted(self.pools):
            self.queue.add(key, "leader")
        log.info("leader: %d pools marked", len(self.pools))

    async def _resync(self) -> None:
        """Every ``resync_seconds``, mark every pool: drift, missed events, back-offs."""
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            if self.paused:
                log.info("resync: standby, %d pools left to the lease holder", len(self.pools))
                continue
            for key in sorted(self.pools):
                self.queue.add(key, "resync")
            log.info("resync: %d pools marked", len(self.pools))

    async def _worker(self) -> None:
        while True:
            key, why = await self.queue.get()
            try:
                delay = await self._pass(key, why)
            except asyncio.CancelledError:
                raise
            except NotLeading as e:  # the lease ran out mid-pass; a new leader marks it again
                log.info("pass of %s/%s stopped: %s", *key, e)
            except Exception:
                retry = self.queue.retry(key)
                log.exception("pass of %s/%s failed; retrying in %.0fs", *key, retry)
            else:
                self.queue.settled(key)
                if delay is not None:
                    self.queue.add_after(key, delay)
            finally:
                self.queue.done(key)

    async def _pass(self, key: PoolKey, why: str) -> float | None:
        """One pass of pool ``key``; the delay after which to look again, if any."""
        if self.paused:
            # The lease holder reconciles; should this replica take the lease over, it
            # marks every pool again (``_started_leading``).
            return None
        packed = self.cache.pool(key)
        pool = packed.unpack() if packed else None
        if packed is None or pool is None or pool["metadata"].get("deletionTimestamp"):
            self.metrics.set_status(*key, None)
            return None
        loop = asyncio.get_running_loop()
        view = PassView(self.cache, loop, key, self.kube, pool["metadata"].get("uid"))
        view.served[(API_VERSION, KIND, key[1])] = packed.resource_version
        return await loop.run_in_executor(self._passes, self._run, pool, view, why)

    def _run(self, pool: Mapping[str, Any], view: PassView, why: str) -> float | None:
        """The pass itself, in a worker thread: reconcile, then metrics and Events."""
        namespace, name = view.pool_key
        now = datetime.now(timezone.utc)
        started = time.monotonic()
        try:
            outcome = reconcile(
                self.kube,
                pool,
                self.defaults,
                now,
                view,
                self._writes,
                view.record,
                self.status_written.get(view.pool_key),
            )
        except ValueError as e:
            status = invalid_status(pool, str(e), now)
            if written := write_status(
                self.kube, namespace, name, pool.get("status") or {}, status
            ):
                view.record((API_VERSION, KIND, name), written)
                events.post(self.kube, pool, "Warning", "InvalidSpec", str(e))
            self.metrics.passes.labels(why, "invalid").inc()
            self.metrics.set_status(namespace, name, status)
            return None  # until the spec changes (its event marks the pool)
        except Exception:
            self.metrics.passes.labels(why, "error").inc()
            raise
        finally:
            self.metrics.seconds.observe(time.monotonic() - started)
        if outcome.wrote_status:
            self.status_written[view.pool_key] = now
        self.metrics.set_status(namespace, name, outcome.status)
        result = "settled" if outcome.requeue_after is None else "waiting"
        self.metrics.passes.labels(why, result).inc()
        for type_, reason, message in events.transition_events(pool, outcome.transitions):
            events.post(self.kube, pool, type_, reason, message)
        if outcome.applied:
            log.info("%s/%s: applied %s", namespace, name, ", ".join(outcome.applied))
        return outcome.requeue_after
