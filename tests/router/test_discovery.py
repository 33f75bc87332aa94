"""Backends from EndpointSlices: parsing, API access, and the list+watch loop
against a fake API server (the real one is in test_cluster.py)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from encoderpool_router.backends import BackendSet
from encoderpool_router.discovery import (
    MANAGED_BY_LABEL,
    SERVICE_NAME_LABEL,
    SLICE_CONTROLLER,
    EndpointSliceWatcher,
    KubeClient,
    kube_client,
    slice_refusal,
    slice_urls,
)
from tests.router.fixtures import run, serve
from tests.waiting import async_wait_until

SERVICE_UID, POOL_UID = "svc-uid", "pool-uid"


def owner(kind: str, name: str, uid: str, controller: bool = True) -> dict[str, Any]:
    api = "v1" if kind == "Service" else "encoderpool.io/v1alpha1"
    return {"apiVersion": api, "kind": kind, "name": name, "uid": uid, "controller": controller}


def eps(
    name: str,
    addrs: list[tuple[str, bool | None]],
    port: int = 8000,
    version: str = "1",
    service_uid: str = SERVICE_UID,
    managed_by: str = SLICE_CONTROLLER,
) -> dict[str, Any]:
    """One slice of Service ``svc``, as the EndpointSlice controller makes them."""
    endpoints = []
    for addr, ready in addrs:
        ep: dict[str, Any] = {"addresses": [addr]}
        if ready is not None:
            ep["conditions"] = {"ready": ready}
        endpoints.append(ep)
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": version,
            "labels": {SERVICE_NAME_LABEL: "svc", MANAGED_BY_LABEL: managed_by},
            "ownerReferences": [owner("Service", "svc", service_uid)],
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def test_only_ready_endpoints_count() -> None:
    obj = eps("s", [("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None)])
    assert slice_urls(obj, None) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]


def test_ports_are_picked_by_name_or_when_alone() -> None:
    obj = eps("s", [("10.0.0.1", True)])
    obj["ports"].append({"name": "metrics", "port": 9000})
    assert slice_urls(obj, None) == []  # ambiguous: logged, nothing used
    assert slice_urls(obj, "metrics") == ["http://10.0.0.1:9000"]
    obj["ports"] = None
    assert slice_urls(obj, None) == []
    v6 = {**eps("s", [("fd00::1", True)]), "addressType": "IPv6"}
    assert slice_urls(v6, "http") == ["http://[fd00::1]:8000"]


def test_kubeconfig_context_gives_server_token_and_namespace(tmp_path: Path) -> None:
    """The kubernetes client reads the kubeconfig; the router takes the context's namespace."""
    conf = {
        "current-context": "b",
        "contexts": [
            {"name": "a", "context": {"cluster": "x", "user": "u"}},
            {"name": "b", "context": {"cluster": "y", "user": "t", "namespace": "ml"}},
        ],
        "clusters": [
            {"name": "x", "cluster": {"server": "https://127.0.0.1:1"}},
            {
                "name": "y",
                "cluster": {"server": "https://127.0.0.1:2/", "insecure-skip-tls-verify": True},
            },
        ],
        "users": [{"name": "u", "user": {}}, {"name": "t", "user": {"token": "abc"}}],
    }  # fmt: skip
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(conf))
    kube = kube_client(str(path))
    try:
        c = kube.api.configuration
        assert c.host.rstrip("/") == "https://127.0.0.1:2"
        assert c.verify_ssl is False
        assert c.auth_settings()["BearerToken"]["value"] == "Bearer abc"
        assert kube.default_namespace == "ml"
    finally:
        kube.close()
    conf["current-context"] = "nope"
    path.write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="nope"):
        kube_client(str(path))


def test_kubeconfig_inline_ca_data_is_loaded(tmp_path: Path) -> None:
    pem = b"-----BEGIN CERTIFICATE-----\nnot really\n-----END CERTIFICATE-----\n"
    conf = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k"}}],
        "clusters": [
            {
                "name": "k",
                "cluster": {
                    "server": "https://h:1",
                    "certificate-authority-data": base64.b64encode(pem).decode(),
                },
            }
        ],
    }
    path = tmp_path / "kc"
    path.write_text(json.dumps(conf))
    kube = kube_client(str(path))
    try:  # the data really was handed to the TLS configuration
        assert Path(kube.api.configuration.ssl_ca_cert).read_bytes() == pem
    finally:
        kube.close()


def test_without_credentials_the_error_says_what_to_give(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(
        ValueError, match="run in a pod with a ServiceAccount, or give --kubeconfig"
    ):
        kube_client(None)


class FakeApi:
    """An API server serving one Service's EndpointSlices, scripted by the test."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 10
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.lists = 0
        self.watches: list[str] = []
        self.fail_lists = 0
        # The Service, controlled by the pool; None: 404; an int: that status.
        self.service: dict[str, Any] | int | None = {
            "metadata": {
                "name": "svc",
                "namespace": "ns",
                "uid": SERVICE_UID,
                "ownerReferences": [owner("EncoderPool", "pool", POOL_UID)],
            }
        }
        self.service_reads = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices", self._get)
        app.router.add_get("/api/v1/namespaces/ns/services/svc", self._service)
        return app

    async def _service(self, request: web.Request) -> web.Response:
        self.service_reads += 1
        if self.service is None or isinstance(self.service, int):
            status = self.service or 404
            return web.json_response({"kind": "Status", "code": status}, status=status)
        return web.json_response(self.service)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        assert request.query["labelSelector"] == "kubernetes.io/service-name=svc"
        assert request.headers["Authorization"] == "Bearer t0ken"
        if "watch" not in request.query:
            self.lists += 1
            if self.fail_lists:
                self.fail_lists -= 1
                return web.json_response({"message": "boom"}, status=500)
            return web.json_response(
                {
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": list(self.slices.values()),
                }
            )
        self.watches.append(request.query["resourceVersion"])
        out = web.StreamResponse()
        await out.prepare(request)
        while (event := await self.events.get()) is not None:
            line = json.dumps(event).encode() + b"\n"
            # Split lines across writes: the watcher must reassemble them.
            await out.write(line[:7])
            await out.write(line[7:])
        return out


def fake_client(url: str) -> KubeClient:
    """The kubernetes client pointed at the fake API server, with a bearer token."""
    from kubernetes import client

    conf = client.Configuration(host=url)
    conf.api_key = {"BearerToken": "Bearer t0ken"}
    return KubeClient(client.ApiClient(conf))


def test_the_watcher_lists_watches_relists_on_410_and_survives_api_errors() -> None:
    async def scenario() -> None:
        api = FakeApi()
        api.slices["a"] = eps("a", [("127.0.0.1", True), ("127.0.0.2", False)])
        target = BackendSet("consumer")
        async with serve(api.app()) as url:
            w = EndpointSliceWatcher(fake_client(url), "ns", "svc", target, max_backoff_s=0.05)
            task = asyncio.create_task(w.run())
            try:
                await async_wait_until("the list", lambda: target.urls == ["http://127.0.0.1:8000"])
                await async_wait_until("the first watch", lambda: api.watches == ["10"])
                b = eps("b", [("127.0.0.3", True)], version="11")
                await api.events.put({"type": "ADDED", "object": b})
                await async_wait_until("ADDED", lambda: len(target) == 2)
                a2 = eps("a", [("127.0.0.1", False), ("127.0.0.2", True)], version="12")
                await api.events.put({"type": "MODIFIED", "object": a2})
                await async_wait_until(
                    "MODIFIED",
                    lambda: target.urls == ["http://127.0.0.2:8000", "http://127.0.0.3:8000"],
                )
                await api.events.put(
                    {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}}
                )
                await api.events.put(None)  # the server ends the watch: resume from the bookmark
                await async_wait_until("a resumed watch", lambda: api.watches == ["10", "15"])
                await api.events.put({"type": "DELETED", "object": b})
                await async_wait_until("DELETED", lambda: target.urls == ["http://127.0.0.2:8000"])
                # 410 Gone: list again, from scratch.
                api.slices = {"c": eps("c", [("127.0.0.9", True)])}
                api.version = 20
                api.fail_lists = 2  # and the API falters: the old backends stay meanwhile
                await api.events.put(
                    {
                        "type": "ERROR",
                        "object": {"code": 410, "reason": "Expired", "message": "too old"},
                    }
                )
                await async_wait_until("failing relists", lambda: api.lists == 3)
                assert target.urls == ["http://127.0.0.2:8000"]
                await async_wait_until(
                    "the relist", lambda: target.urls == ["http://127.0.0.9:8000"]
                )
                await async_wait_until("a watch from the new list", lambda: api.watches[-1] == "20")
            finally:
                task.cancel()
                await api.events.put(None)
                with pytest.raises(asyncio.CancelledError):
                    await task

    run(scenario())


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({}, None),
        ({"managed_by": "someone-else"}, "not_managed"),
        ({"managed_by": ""}, "not_managed"),
        ({"service_uid": "another-uid"}, "not_owned"),
    ],
)
def test_a_slice_counts_only_when_the_controller_made_it_for_the_service_s_uid(
    change: dict[str, Any], why: str | None
) -> None:
    obj = eps("s", [("10.0.0.1", True)], **change)
    assert slice_refusal(obj, "svc", SERVICE_UID) == why


@pytest.mark.parametrize(
    "owners",
    [
        [],
        [owner("Service", "svc", SERVICE_UID, controller=False)],
        [owner("Service", "other", SERVICE_UID)],
        [{**owner("Service", "svc", SERVICE_UID), "apiVersion": "example.com/v1"}],
        [owner("Deployment", "svc", SERVICE_UID)],
    ],
    ids=["none", "not-controller", "other-name", "other-group", "other-kind"],
)
def test_a_slice_not_controlled_by_the_service_is_refused(owners: list[Any]) -> None:
    obj = eps("s", [("10.0.0.1", True)])
    obj["metadata"]["ownerReferences"] = owners
    assert slice_refusal(obj, "svc", SERVICE_UID) == "not_owned"
    # Without the Service's uid nothing is the Service's.
    assert slice_refusal(eps("s", []), "svc", None) == "not_owned"


def test_forged_slices_are_ignored_logged_once_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        api = FakeApi()
        api.slices["real"] = eps("real", [("10.0.0.1", True)])
        api.slices["forged"] = eps("forged", [("10.6.6.6", True)], managed_by="me")
        api.slices["stolen"] = eps("stolen", [("10.6.6.7", True)], service_uid="x")
        target, seen = BackendSet("consumer"), list[str]()
        async with serve(api.app()) as url:
            w = EndpointSliceWatcher(
                fake_client(url), "ns", "svc", target, pool_uid=POOL_UID, ignored=seen.append
            )
            task = asyncio.create_task(w.run())
            try:
                await async_wait_until("the list", lambda: target.urls == ["http://10.0.0.1:8000"])
                await async_wait_until("the watch", lambda: len(api.watches) == 1)
                assert sorted(seen) == ["not_managed", "not_owned"]
                # A forgery changes (not logged again); the real slice's label changes: it
                # stops counting.
                forged2 = eps("forged", [("10.6.6.8", True)], version="9", managed_by="me")
                await api.events.put({"type": "MODIFIED", "object": forged2})
                real2 = eps("real", [("10.0.0.2", True)], version="10", managed_by="x")
                await api.events.put({"type": "MODIFIED", "object": real2})
                await async_wait_until("no backends", lambda: len(target) == 0)
                assert len(seen) == 4
            finally:
                task.cancel()
                await api.events.put(None)
                with pytest.raises(asyncio.CancelledError):
                    await task
        logged = [
            r.getMessage() for r in caplog.records if "ignoring EndpointSlice" in r.getMessage()
        ]
        assert sorted(m.split(":")[1].strip() for m in logged) == [
            "ignoring EndpointSlice forged",
            "ignoring EndpointSlice real",
            "ignoring EndpointSlice stolen",
        ]  # the forged slice's second event was not logged again

    run(scenario())


@pytest.mark.parametrize(
    ("service", "reason"),
    [
        ("another pool", "service_not_owned"),
        ("no controller", "service_not_owned"),
        (403, "service_unreadable"),
    ],
)
def test_slices_of_a_service_the_pool_does_not_control_are_never_used(
    service: str | int, reason: str
) -> None:
    async def scenario() -> None:
        api = FakeApi()
        api.slices["a"] = eps("a", [("10.0.0.1", True)])
        assert isinstance(api.service, dict)
        if service == "another pool":
            api.service["metadata"]["ownerReferences"] = [owner("EncoderPool", "p", "other")]
        elif service == "no controller":
            api.service["metadata"]["ownerReferences"] = []
        else:
            api.service = int(service)
        target, seen = BackendSet("consumer", ["http://10.9.9.9:1"]), list[str]()
        async with serve(api.app()) as url:
            w = EndpointSliceWatcher(
                fake_client(url), "ns", "svc", target, pool_uid=POOL_UID, ignored=seen.append
            )
            task = asyncio.create_task(w.run())
            try:
                await async_wait_until("the list", lambda: api.lists == 1)
                await async_wait_until("emptied", lambda: len(target) == 0)
                assert seen[0] == reason
            finally:
                task.cancel()
                await api.events.put(None)
                with pytest.raises(asyncio.CancelledError):
                    await task

    run(scenario())


def test_a_recreated_service_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("encoderpool_router.discovery.SERVICE_RECHECK_S", 0.0)

    async def scenario() -> None:
        api = FakeApi()
        api.slices["a"] = eps("a", [("10.0.0.1", True)])
        target = BackendSet("consumer")
        async with serve(api.app()) as url:
            w = EndpointSliceWatcher(fake_client(url), "ns", "svc", target, pool_uid=POOL_UID)
            task = asyncio.create_task(w.run())
            try:
                await async_wait_until("the list", lambda: len(target) == 1)
                await async_wait_until("the watch", lambda: len(api.watches) == 1)
                assert isinstance(api.service, dict)
                api.service["metadata"]["uid"] = "new-uid"  # deleted and made again
                api.slices = {"b": eps("b", [("10.0.0.2", True)], service_uid="new-uid")}
                await api.events.put({"type": "ADDED", "object": api.slices["b"]})
                await async_wait_until(
                    "the new slice", lambda: target.urls == ["http://10.0.0.2:8000"]
                )
                assert api.service_reads == 2
                assert w.service_uid == "new-uid"
            finally:
                task.cancel()
                await api.events.put(None)
                with pytest.raises(asyncio.CancelledError):
                    await task

    run(scenario())
