"""Backends from EndpointSlices: parsing, API access, and the list+watch loop
against a fake API server (the real one is in test_router_cluster.py)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from encoderpool_connector.router.backends import (
    BackendSet,
    EndpointSliceWatcher,
    KubeAccess,
    in_cluster_access,
    kube_access,
    kubeconfig_access,
    slice_urls,
)
from tests.fixtures_router import run, serve, wait_until


def eps(
    name: str, addrs: list[tuple[str, bool | None]], port: int = 8000, version: str = "1"
) -> dict[str, Any]:
    endpoints = []
    for addr, ready in addrs:
        ep: dict[str, Any] = {"addresses": [addr]}
        if ready is not None:
            ep["conditions"] = {"ready": ready}
        endpoints.append(ep)
    return {
        "metadata": {"name": name, "resourceVersion": version},
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


def test_kubeconfig_with_cert_files_token_and_inline_data(tmp_path: Path) -> None:
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
    access = kubeconfig_access(path)
    assert access.server == "https://127.0.0.1:2"
    assert access.ssl is False
    assert access.headers() == {"Authorization": "Bearer abc"}
    assert access.default_namespace == "ml"
    # YAML works too (PyYAML is present here), and exec users are refused with the fix.
    conf["users"][1]["user"] = {"exec": {"command": "aws"}}  # type: ignore[index]
    path.write_text("# yaml\n" + json.dumps(conf))
    with pytest.raises(ValueError, match="exec/auth-provider users are not supported"):
        kubeconfig_access(path)
    conf["current-context"] = "nope"
    path.write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="no context named 'nope'"):
        kubeconfig_access(path)


def test_kubeconfig_inline_ca_data_is_loaded(tmp_path: Path) -> None:
    bogus = base64.b64encode(b"not a certificate").decode()
    conf = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k"}}],
        "clusters": [
            {"name": "k", "cluster": {"server": "https://h:1", "certificate-authority-data": bogus}}
        ],
    }
    path = tmp_path / "kc"
    path.write_text(json.dumps(conf))
    with pytest.raises(Exception, match=r"PEM|certificate|no start line"):
        kubeconfig_access(path)  # the data really was handed to the TLS context


def test_in_cluster_access_reads_the_mounted_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="give --kubeconfig"):
        in_cluster_access(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    with pytest.raises(ValueError, match="no ServiceAccount token"):
        in_cluster_access(tmp_path)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(
        ValueError, match="run in a pod with a ServiceAccount, or give --kubeconfig"
    ):
        kube_access(None)


class FakeApi:
    """An API server serving one Service's EndpointSlices, scripted by the test."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 10
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.lists = 0
        self.watches: list[str] = []
        self.fail_lists = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices", self._get)
        return app

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


def test_the_watcher_lists_watches_relists_on_410_and_survives_api_errors() -> None:
    async def scenario() -> None:
        api = FakeApi()
        api.slices["a"] = eps("a", [("127.0.0.1", True), ("127.0.0.2", False)])
        target = BackendSet("consumer")
        async with serve(api.app()) as url, aiohttp.ClientSession() as session:
            access = KubeAccess(server=url, ssl=False, token="t0ken")
            w = EndpointSliceWatcher(access, "ns", "svc", target, max_backoff_s=0.05)
            task = asyncio.create_task(w.run(session))
            try:
                await wait_until(lambda: target.urls == ["http://127.0.0.1:8000"], "the list")
                assert api.watches == ["10"]
                b = eps("b", [("127.0.0.3", True)], version="11")
                await api.events.put({"type": "ADDED", "object": b})
                await wait_until(lambda: len(target) == 2, "ADDED")
                a2 = eps("a", [("127.0.0.1", False), ("127.0.0.2", True)], version="12")
                await api.events.put({"type": "MODIFIED", "object": a2})
                await wait_until(
                    lambda: target.urls == ["http://127.0.0.2:8000", "http://127.0.0.3:8000"],
                    "MODIFIED",
                )
                await api.events.put(
                    {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}}
                )
                await api.events.put(None)  # the server ends the watch: resume from the bookmark
                await wait_until(lambda: api.watches == ["10", "15"], "a resumed watch")
                await api.events.put({"type": "DELETED", "object": b})
                await wait_until(lambda: target.urls == ["http://127.0.0.2:8000"], "DELETED")
                # 410 Gone: list again, from scratch.
                api.slices = {"c": eps("c", [("127.0.0.9", True)])}
                api.version = 20
                api.fail_lists = 2  # and the API falters: the old backends stay meanwhile
                await api.events.put(
                    {"type": "ERROR", "object": {"code": 410, "message": "too old"}}
                )
                await wait_until(lambda: api.lists == 3, "failing relists")
                assert target.urls == ["http://127.0.0.2:8000"]
                await wait_until(lambda: target.urls == ["http://127.0.0.9:8000"], "the relist")
                await wait_until(lambda: api.watches[-1] == "20", "a watch from the new list")
            finally:
                task.cancel()
                await api.events.put(None)
                with pytest.raises(asyncio.CancelledError):
                    await task

    run(scenario())
