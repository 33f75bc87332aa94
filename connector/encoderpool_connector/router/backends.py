"""The router's backends: a live set per role, filled from flags or from EndpointSlices.

The watcher lists and watches ``discovery.k8s.io/v1`` EndpointSlices of one
Service with plain aiohttp (the router image has no Kubernetes client), so
scaling and rolling updates reach the router without a restart. Only ready
endpoints count. When the API server is unreachable the last known backends
stay in use: losing the control plane must not take the data path down.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import ssl
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

logger = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


@dataclass(eq=False)
class Backend:
    """One producer or consumer; counters survive EndpointSlice updates."""

    url: str
    in_flight: int = 0
    ejected_until: float = 0.0

    def __repr__(self) -> str:
        return f"Backend({self.url}, in_flight={self.in_flight})"


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


# --- Kubernetes API access ------------------------------------------------------------


@dataclass
class KubeAccess:
    """Where the API server is and how to authenticate to it."""

    server: str
    ssl: ssl.SSLContext | bool
    token: str | None = None
    token_file: Path | None = None  # re-read per request: projected tokens rotate
    default_namespace: str | None = None

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file is not None:
            token = self.token_file.read_text().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}


def in_cluster_access(sa_dir: Path = SA_DIR) -> KubeAccess:
    """The pod's ServiceAccount: token and CA mounted by the kubelet."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ValueError("not in a pod (KUBERNETES_SERVICE_HOST unset): give --kubeconfig")
    if not (sa_dir / "token").exists():
        raise ValueError(
            f"no ServiceAccount token at {sa_dir}/token: mount one "
            "(automountServiceAccountToken: true) or give --kubeconfig"
        )
    ns_file = sa_dir / "namespace"
    host = f"[{host}]" if ":" in host else host
    return KubeAccess(
        server=f"https://{host}:{port}",
        ssl=ssl.create_default_context(cafile=str(sa_dir / "ca.crt")),
        token_file=sa_dir / "token",
        default_namespace=ns_file.read_text().strip() if ns_file.exists() else None,
    )


def _load_kubeconfig(path: Path) -> dict[str, Any]:
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            import yaml  # optional: the router's extra does not need it for JSON kubeconfigs
        except ImportError:
            raise ValueError(
                f"kubeconfig {path} is YAML but PyYAML is not installed: install pyyaml "
                "or give a JSON kubeconfig"
            ) from None
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"kubeconfig {path} is not a mapping")
    return data


def _named(items: Any, name: str, kind: str, path: Path) -> dict[str, Any]:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            value = item.get(kind)
            if isinstance(value, dict):
                return value
    raise ValueError(f"kubeconfig {path}: no {kind} named {name!r}")


@contextlib.contextmanager
def _pem_file(conf: dict[str, Any], key: str, base: Path) -> Iterator[str | None]:
    """``key`` as a file path: the path given, or ``key-data`` written to a private temp file."""
    if isinstance(conf.get(key), str):
        p = Path(conf[key])
        yield str(p if p.is_absolute() else base / p)
        return
    data = conf.get(f"{key}-data")
    if not isinstance(data, str):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="encoderpool-router-") as d:
        f = Path(d) / "pem"
        f.write_bytes(base64.b64decode(data))
        yield str(f)


def kubeconfig_access(path: Path) -> KubeAccess:
    """The current context of a kubeconfig: server, CA, client cert or token."""
    conf = _load_kubeconfig(path)
    ctx_name = conf.get("current-context")
    if not isinstance(ctx_name, str):
        raise ValueError(f"kubeconfig {path} has no current-context")
    ctx = _named(conf.get("contexts"), ctx_name, "context", path)
    cluster = _named(conf.get("clusters"), str(ctx.get("cluster")), "cluster", path)
    user = _named(conf.get("users"), str(ctx.get("user")), "user", path) if ctx.get("user") else {}
    if "exec" in user or "auth-provider" in user:
        raise ValueError(
            f"kubeconfig {path}: exec/auth-provider users are not supported by the router; "
            "use a client certificate or a token"
        )
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("https://", "http://")):
        raise ValueError(f"kubeconfig {path}: cluster {ctx.get('cluster')!r} has no server URL")
    base = path.parent
    ctx_ssl: ssl.SSLContext | bool = True
    if server.startswith("https://"):
        if cluster.get("insecure-skip-tls-verify"):
            ctx_ssl = False
        else:
            with _pem_file(cluster, "certificate-authority", base) as ca:
                ctx_ssl = ssl.create_default_context(cafile=ca)
            with (
                _pem_file(user, "client-certificate", base) as cert,
                _pem_file(user, "client-key", base) as key,
            ):
                if cert:
                    ctx_ssl.load_cert_chain(cert, key)
    token_file = user.get("tokenFile")
    return KubeAccess(
        server=server.rstrip("/"),
        ssl=ctx_ssl,
        token=user.get("token") if isinstance(user.get("token"), str) else None,
        token_file=Path(token_file) if isinstance(token_file, str) else None,
        default_namespace=ctx.get("namespace") if isinstance(ctx.get("namespace"), str) else None,
    )


def kube_access(kubeconfig: str | None) -> KubeAccess:
    """``--kubeconfig`` if given, else the pod's ServiceAccount, else $KUBECONFIG."""
    if kubeconfig:
        return kubeconfig_access(Path(kubeconfig))
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster_access()
    env = os.environ.get("KUBECONFIG")
    if env:
        return kubeconfig_access(Path(env.split(os.pathsep)[0]))
    raise ValueError(
        "--producer-service/--consumer-service need API access: run in a pod with a "
        "ServiceAccount, or give --kubeconfig (or set KUBECONFIG)"
    )


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


class _Expired(Exception):
    """The watch's resourceVersion is gone (410): list again."""


@dataclass
class EndpointSliceWatcher:
    """Keeps ``target`` equal to the ready endpoints of one Service's EndpointSlices."""

    access: KubeAccess
    namespace: str
    service: str
    target: BackendSet
    port_name: str | None = None
    watch_timeout_s: int = 290
    max_backoff_s: float = 30.0
    _slices: dict[str, list[str]] = field(default_factory=dict)
    synced: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def _path(self) -> str:
        selector = quote(f"{SERVICE_NAME_LABEL}={self.service}", safe="")
        return (
            f"{self.access.server}/apis/discovery.k8s.io/v1/namespaces/{self.namespace}"
            f"/endpointslices?labelSelector={selector}"
        )

    def _publish(self) -> None:
        self.target.replace(u for urls in self._slices.values() for u in urls)

    async def run(self, session: aiohttp.ClientSession) -> None:
        """List, then watch from that version; on 410 or any failure, list again (backing off)."""
        backoff = 0.5
        while True:
            try:
                version = await self._list(session)
                backoff = 0.5
                while True:
                    version = await self._watch(session, version)
            except _Expired:
                logger.info("EndpointSlice watch of %s expired; listing again", self.service)
            except (aiohttp.ClientError, TimeoutError, ValueError, RuntimeError) as e:
                logger.warning(
                    "EndpointSlices of %s/%s: %s; keeping %s, retrying in %.1fs",
                    self.namespace,
                    self.service,
                    e,
                    self.target.urls,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)

    async def _list(self, session: aiohttp.ClientSession) -> str:
        async with session.get(
            self._path,
            headers=self.access.headers(),
            ssl=self.access.ssl,
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp:
            if resp.status != 200:
                raise RuntimeError(_api_error(resp.status, await resp.text(), self.service))
            body = await resp.json(content_type=None)
        self._slices = {
            item["metadata"]["name"]: slice_urls(item, self.port_name)
            for item in body.get("items") or []
        }
        self._publish()
        self.synced.set()
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, session: aiohttp.ClientSession, version: str) -> str:
        url = (
            f"{self._path}&watch=1&allowWatchBookmarks=true"
            f"&resourceVersion={quote(version)}&timeoutSeconds={self.watch_timeout_s}"
        )
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=30, sock_read=self.watch_timeout_s + 30
        )
        async with session.get(
            url, headers=self.access.headers(), ssl=self.access.ssl, timeout=timeout
        ) as resp:
            if resp.status == 410:
                raise _Expired
            if resp.status != 200:
                raise RuntimeError(_api_error(resp.status, await resp.text(), self.service))
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        version = self._apply(json.loads(line), version)
        return version

    def _apply(self, event: dict[str, Any], version: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired
            raise RuntimeError(f"watch error: {obj.get('message', obj)}")
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED"):
            self._slices[meta["name"]] = slice_urls(obj, self.port_name)
            self._publish()
        elif kind == "DELETED":
            self._slices.pop(str(meta.get("name")), None)
            self._publish()
        return str(meta.get("resourceVersion") or version)


def _api_error(status: int, text: str, service: str) -> str:
    if status in (401, 403):
        return (
            f"API server refused listing EndpointSlices of {service} ({status}); grant the "
            "router's ServiceAccount get/list/watch on endpointslices.discovery.k8s.io"
        )
    return f"API server answered {status}: {text[:300]}"
