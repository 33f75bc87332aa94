"""Backends from EndpointSlices: each watched Service's ready endpoints kept in a set.

The watcher lists and watches ``discovery.k8s.io/v1`` EndpointSlices of one
Service with the maintained ``kubernetes`` client (which loads in-cluster or
kubeconfig credentials, exec plugins and token rotation included), so scaling
and rolling updates reach the router without a restart. Only ready endpoints
count. When the API server is unreachable the last known backends stay in
use: losing the control plane must not take the data path down.

That client is synchronous: each watcher's list+watch runs in a daemon thread
that hands complete snapshots to the asyncio loop (a queue of one: a newer
snapshot replaces one not yet applied), so the proxy's loop never blocks on
the API server.

Anyone who may create EndpointSlices in the namespace can label one with the
Service's name, so the label only finds candidates: a slice counts only when the
EndpointSlice controller manages it and it is owned by the Service (its uid, read
with each list), and, given the pool's uid, the Service only when the pool
controls it. Other slices are ignored, logged once and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderpool_router.backends import BackendSet
from encoderpool_router.config import RouterSettings

logger = logging.getLogger(__name__)

SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
SLICE_CONTROLLER = "endpointslice-controller.k8s.io"
# Why a slice or Service is not used (the label of encoderpool_router_endpointslices_ignored).
IGNORED_REASONS = ("not_managed", "not_owned", "service_not_owned", "service_unreadable")
# At most this often a slice owned by another uid of our Service's name makes the
# watcher read the Service again (it may have been recreated).
SERVICE_RECHECK_S = 10.0


@contextlib.asynccontextmanager
async def follow(
    settings: RouterSettings,
    targets: Sequence[tuple[str, BackendSet]],
    ignored: Callable[[str], None] | None = None,
) -> AsyncIterator[list[EndpointSliceWatcher]]:
    """Keep each set of ``targets`` (Service name, set) equal to its Service's ready
    endpoints for the duration of the block; ValueError when no namespace is known."""
    kube = kube_client(settings.kubeconfig)
    namespace = settings.namespace or kube.default_namespace
    if not namespace:
        kube.close()
        raise ValueError("--namespace is required outside a pod (no default namespace)")
    watchers = [
        EndpointSliceWatcher(
            kube,
            namespace,
            service,
            target,
            settings.endpoint_port_name,
            pool_uid=settings.pool_uid,
            ignored=ignored,
        )
        for service, target in targets
    ]
    tasks = [asyncio.create_task(w.run(), name=f"watch-{w.service}") for w in watchers]
    try:
        yield watchers
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        kube.close()


# --- Kubernetes API access ------------------------------------------------------------


@dataclass
class KubeClient:
    """A configured ``kubernetes.client.ApiClient`` and the namespace its context implies."""

    api: Any  # kubernetes.client.ApiClient (the client is untyped)
    default_namespace: str | None = None

    def close(self) -> None:
        self.api.close()


def kube_client(kubeconfig: str | None) -> KubeClient:
    """``--kubeconfig`` if given, else the pod's ServiceAccount, else $KUBECONFIG or
    ~/.kube/config; ValueError saying what to give when none works."""
    from kubernetes import client, config

    conf = client.Configuration()
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=conf)
            namespace = SA_NAMESPACE.read_text().strip() if SA_NAMESPACE.exists() else None
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=conf)
            _, current = config.list_kube_config_contexts(config_file=kubeconfig)
            namespace = (current.get("context") or {}).get("namespace")
    except (config.ConfigException, OSError) as e:
        raise ValueError(
            "--producer-service/--consumer-service need API access: run in a pod with a "
            f"ServiceAccount, or give --kubeconfig (or set KUBECONFIG): {e}"
        ) from None
    return KubeClient(client.ApiClient(conf), namespace if isinstance(namespace, str) else None)


# --- EndpointSlices ---------------------------------------------------------------------


def slice_urls(obj: dict[str, Any], port_name: str | None, scheme: str = "http") -> list[str]:
    """Base URLs of the ready endpoints of one EndpointSlice.

    ``ready`` unset counts as ready (the API's documented meaning); a slice
    without the wanted port contributes nothing.
    """
    ports = [p for p in obj.get("ports") or [] if isinstance(p, dict) and p.get("port")]
    if port_name is not None:
        ports = [p for p in ports if p.get("name") == port_name]
    if len(ports) != 1:
        if ports or obj.get("endpoints"):
            logger.warning(
                "EndpointSlice %s: cannot pick a port from %s (set --endpoint-port-name)",
                obj.get("metadata", {}).get("name"),
                [p.get("name") for p in obj.get("ports") or []],
            )
        return []
    port = int(ports[0]["port"])
    ipv6 = obj.get("addressType") == "IPv6"
    urls = []
    for ep in obj.get("endpoints") or []:
        if (ep.get("conditions") or {}).get("ready") is False:
            continue
        for addr in ep.get("addresses") or []:
            host = f"[{addr}]" if ipv6 else addr
            urls.append(f"{scheme}://{host}:{port}")
    return urls


Snapshot = dict[str, list[str]]  # EndpointSlice name -> its ready backend URLs


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``obj``'s controller ownerReference (controller: true), if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            return ref
    return None


def slice_refusal(obj: Mapping[str, Any], service: str, service_uid: str | None) -> str | None:
    """Why an EndpointSlice labelled with ``service`` is not the Service's own; None if it is.

    Its own: managed by the EndpointSlice controller and controlled by the Service of
    that name and uid (``service_uid`` None: the Service's uid is unknown, so none is)."""
    meta = obj.get("metadata") or {}
    if (meta.get("labels") or {}).get(MANAGED_BY_LABEL) != SLICE_CONTROLLER:
        return "not_managed"
    owner = controller_of(obj) or {}
    if (
        service_uid is None
        or owner.get("kind") != "Service"
        or owner.get("apiVersion") != "v1"
        or owner.get("name") != service
        or owner.get("uid") != service_uid
    ):
        return "not_owned"
    return None


class _LogOnce:
    """Remembers what was logged (a bounded number), so each ignored object is logged once."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._seen: OrderedDict[tuple[str, ...], None] = OrderedDict()

    def first(self, *key: str) -> bool:
        if key in self._seen:
            return False
        self._seen[key] = None
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return True


class EndpointSliceWatcher:
    """Keeps ``target`` equal to the ready endpoints of one Service's EndpointSlices."""

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        service: str,
        target: BackendSet,
        port_name: str | None = None,
        watch_timeout_s: int = 290,
        max_backoff_s: float = 30.0,
        pool_uid: str | None = None,
        ignored: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.service = service
        self.target = target
        self.port_name = port_name
        self.watch_timeout_s = watch_timeout_s
        self.max_backoff_s = max_backoff_s
        # Given (the operator passes it): the Service counts only when this pool controls it.
        self.pool_uid = pool_uid
        self.ignored = ignored  # called with a reason (IGNORED_REASONS) per ignored object
        self.service_uid: str | None = None  # the Service's uid, once read and trusted
        self._service_read_at = float("-inf")
        self._relist = False
        self._logged = _LogOnce()
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._watch: Any = None  # the kubernetes Watch in progress, to stop it from outside

    async def run(self) -> None:
        """Follow the Service until cancelled: the thread lists and watches, this applies."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Snapshot] = asyncio.Queue(maxsize=1)

        def offer(snapshot: Snapshot) -> None:  # on the loop: keep only the newest
            if updates.full():
                updates.get_nowait()
            updates.put_nowait(snapshot)

        def hand_over(snapshot: Snapshot) -> bool:  # on the thread
            try:
                loop.call_soon_threadsafe(offer, snapshot)
                return True
            except RuntimeError:  # the loop is closed: nobody is listening any more
                return False

        thread = threading.Thread(
            target=self._follow, args=(hand_over,), name=f"watch-{self.service}", daemon=True
        )
        thread.start()
        try:
            while True:
                snapshot = await updates.get()
                self.target.replace(u for urls in snapshot.values() for u in urls)
        finally:
            self.stop()

    def stop(self) -> None:
        """End the thread's watch now (it exits at its next step)."""
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _follow(self, hand_over: Callable[[Snapshot], bool]) -> None:
        """List, then watch from that version; on 410 or any failure list again, backing off."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        api = client.DiscoveryV1Api(self.client.api)
        backoff = 0.5
        while not self._stop.is_set():
            try:
                slices, version = self._list(api)
                if not hand_over(dict(slices)):
                    return
                self.synced.set()
                backoff = 0.5
                while not self._stop.is_set() and not self._relist:
                    version = self._watch_once(api, slices, version, hand_over)
            except ApiException as e:
                if e.status == 410:
                    logger.info("EndpointSlice watch of %s expired; listing again", self.service)
                    continue
                self._retry_later(_api_error(e.status, str(e.reason), self.service), backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
            except Exception as e:  # unreachable, timed out, garbled: keep the backends
                self._retry_later(repr(e), backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    def _retry_later(self, problem: str, backoff: float) -> None:
        logger.warning(
            "EndpointSlices of %s/%s: %s; keeping %s, retrying in %.1fs",
            self.namespace,
            self.service,
            problem,
            self.target.urls,
            backoff,
        )
        self._stop.wait(backoff)

    def _ignore(self, reason: str, what: str, uid: str, detail: str) -> None:
        if self.ignored is not None:
            self.ignored(reason)
        if self._logged.first(reason, what, uid):
            logger.warning("%s/%s: ignoring %s: %s", self.namespace, self.service, what, detail)

    def _read_service(self) -> None:
        """The Service's uid, kept only if it is trusted (see the module docstring).

        Without the pool's uid (a local run, or an operator that does not pass it) the
        Service is taken as it is; a Service this router may not read then leaves only
        the slice checks that need no uid: such slices are refused (fail closed)."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        self._service_read_at = time.monotonic()
        self.service_uid = None
        where = f"Service {self.namespace}/{self.service}"
        try:
            resp = client.CoreV1Api(self.client.api).read_namespaced_service(
                self.service, self.namespace, _request_timeout=30
            )
        except ApiException as e:
            if e.status == 404:
                logger.info("%s does not exist (yet); no backends from it", where)
                return
            if e.status not in (401, 403):
                raise
            self._ignore(
                "service_unreadable",
                where,
                str(e.status),
                f"the API server refused reading it ({e.status}), so no EndpointSlice can be "
                "checked against its uid and none is used; grant the router's ServiceAccount "
                f"get on services {self.service} (the operator's Role for the router does)",
            )
            return
        svc = self.client.api.sanitize_for_serialization(resp)
        uid = str((svc.get("metadata") or {}).get("uid") or "")
        owner = controller_of(svc) or {}
        if self.pool_uid is not None and owner.get("uid") != self.pool_uid:
            self._ignore(
                "service_not_owned",
                where,
                uid,
                f"it is not controlled by this router's pool (uid {self.pool_uid}; its "
                f"controller: {owner.get('kind')} {owner.get('name')} {owner.get('uid')}), "
                "so none of its EndpointSlices is used: delete or rename it, and the operator "
                "makes the pool's own",
            )
            return
        self.service_uid = uid or None

    def _accept(self, obj: Mapping[str, Any]) -> bool:
        """Whether ``obj`` is one of the Service's own slices (else ignored: logged once,
        counted). A slice of our Service's name but another uid reads the Service again
        (at most every SERVICE_RECHECK_S): it may have been recreated."""
        why = slice_refusal(obj, self.service, self.service_uid)
        if why is None:
            return True
        meta = obj.get("metadata") or {}
        owner = controller_of(obj) or {}
        if (
            why == "not_owned"
            and owner.get("kind") == "Service"
            and owner.get("name") == self.service
            and time.monotonic() - self._service_read_at >= SERVICE_RECHECK_S
        ):
            self._relist = True
        if why == "not_managed":
            detail = (
                f"its {MANAGED_BY_LABEL} label is "
                f"{(meta.get('labels') or {}).get(MANAGED_BY_LABEL)!r}, not {SLICE_CONTROLLER!r}"
            )
        else:
            detail = (
                f"its controller is {owner.get('kind')} {owner.get('name')} uid "
                f"{owner.get('uid')}, not the Service (uid {self.service_uid})"
            )
        what = f"EndpointSlice {meta.get('name')}"
        self._ignore(why, what, str(meta.get("uid") or meta.get("name")), detail)
        return False

    def _list(self, api: Any) -> tuple[Snapshot, str]:
        self._read_service()
        self._relist = False
        resp = api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=f"{SERVICE_NAME_LABEL}={self.service}",
            _request_timeout=30,
        )
        raw = self.client.api.sanitize_for_serialization(resp)
        slices = {
            item["metadata"]["name"]: slice_urls(item, self.port_name)
            for item in raw.get("items") or []
            if self._accept(item)
        }
        return slices, str(raw["metadata"]["resourceVersion"])

    def _watch_once(
        self, api: Any, slices: Snapshot, version: str, hand_over: Callable[[Snapshot], bool]
    ) -> str:
        """One watch request (the server ends it after ``watch_timeout_s``); the last version."""
        from kubernetes import watch

        self._watch = watch.Watch()
        for event in self._watch.stream(
            api.list_namespaced_endpoint_slice,
            self.namespace,
            label_selector=f"{SERVICE_NAME_LABEL}={self.service}",
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s,
            _request_timeout=(30, self.watch_timeout_s + 30),
        ):
            kind, obj = event.get("type"), event.get("raw_object") or {}
            meta = obj.get("metadata") or {}
            if kind in ("ADDED", "MODIFIED"):
                if self._accept(obj):
                    slices[meta["name"]] = slice_urls(obj, self.port_name)
                else:  # it may have been ours before this change
                    slices.pop(str(meta.get("name")), None)
            elif kind == "DELETED":
                slices.pop(str(meta.get("name")), None)
            version = str(meta.get("resourceVersion") or version)
            if kind != "BOOKMARK" and not hand_over(dict(slices)):
                self._stop.set()
            if self._stop.is_set() or self._relist:
                break
        return version


def _api_error(status: int, text: str, service: str) -> str:
    if status in (401, 403):
        return (
            f"API server refused listing EndpointSlices of {service} ({status}); grant the "
            "router's ServiceAccount get/list/watch on endpointslices.discovery.k8s.io"
        )
    return f"API server answered {status}: {text[:300]}"
