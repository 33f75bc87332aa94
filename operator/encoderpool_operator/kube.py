"""The operator's one way to talk to the API server.

Explicit paths for the handful of kinds the operator manages (no discovery),
server-side apply with one field manager, 404/409 handled by explicit flags,
and a count of every write so tests and benchmarks can prove a no-op
reconcile writes nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any
from urllib.parse import urlencode

from encoderpool_operator.kinds import KINDS
from encoderpool_operator.naming import FIELD_MANAGER

# Every request's (connect, read) timeout: a pass holds its pool's place in the work
# queue while it talks to the API server, so a call that hangs must fail (the queue
# retries the pass with back-off) instead.
REQUEST_TIMEOUT = (5.0, 30.0)

# (apiVersion, kind) -> plural: everything the operator reads or writes (``kinds.KINDS``).
PLURALS: dict[tuple[str, str], str] = {k.key: k.plural for k in KINDS}
_NAMESPACED = {k.key: k.namespaced for k in KINDS}


class KubeError(RuntimeError):
    """A request the API server refused; carries the HTTP status and its message."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: {status} {message}")
        self.status = status


def path(
    api_version: str,
    kind: str,
    namespace: str,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    plural = PLURALS[(api_version, kind)]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if _NAMESPACED[(api_version, kind)]:
        base += f"/namespaces/{namespace}"
    out = f"{base}/{plural}"
    if name:
        out += f"/{name}"
    if subresource:
        out += f"/{subresource}"
    return out


class RateLimiter:
    """A token bucket: ``qps`` requests a second on average, bursts of up to ``burst``.

    What client-go's client does: an operator that starts thousands of writes at once
    (a restart over many pools) spreads them instead of flooding the API server.
    """

    def __init__(self, qps: float, burst: int) -> None:
        self.qps, self.burst = qps, burst
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def wait(self) -> None:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= 1
            delay = -self._tokens / self.qps if self._tokens < 0 else 0.0
        if delay > 0:
            time.sleep(delay)


class Kube:
    """A thin, thread-safe wrapper over a ``kubernetes.client.ApiClient``."""

    def __init__(
        self,
        api_client: Any,
        field_manager: str = FIELD_MANAGER,
        timeout: tuple[float, float] = REQUEST_TIMEOUT,
        limiter: RateLimiter | None = None,
    ) -> None:
        self._api = api_client
        self.field_manager = field_manager
        self.timeout = timeout  # (connect, read) seconds: a hung call fails, never wedges
        self.limiter = limiter
        self.writes: Counter[str] = Counter()  # "VERB Kind" -> count
        self.reads: Counter[str] = Counter()  # "GET path-kind" -> count, for the profile
        self._lock = threading.Lock()

    def request(
        self,
        method: str,
        url_path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        kind: str = "",
    ) -> Any:
        with self._lock:
            if method == "GET":
                self.reads[kind or url_path] += 1
            else:
                self.writes[f"{method} {kind or url_path}"] += 1
        if self.limiter is not None:
            self.limiter.wait()
        full = url_path + ("?" + urlencode(query) if query else "")
        _method, url, headers, payload, _post = self._api.param_serialize(
            method=method,
            resource_path=full,
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self._api.call_api(
            method, url, header_params=headers, body=payload, _request_timeout=self.timeout
        )
        data = resp.read()
        if resp.status >= 400:
            try:
                message = json.loads(data).get("message", "")
            except ValueError:
                message = data[:500].decode(errors="replace")
            raise KubeError(resp.status, method, url_path, message)
        return json.loads(data) if data else None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            obj: dict[str, Any] = self.request(
                "GET", path(api_version, kind, namespace, name), kind=kind
            )
        except KubeError as e:
            if e.status == 404:
                return None
            raise
        return obj

    def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str = ""
    ) -> list[dict[str, Any]]:
        """The objects of a kind in a namespace; none where the kind is not served (KEDA's
        ScaledObject in a cluster without KEDA: a pool can still ask for it)."""
        query = {"labelSelector": label_selector} if label_selector else None
        try:
            items: list[dict[str, Any]] = self.request(
                "GET", path(api_version, kind, namespace), query=query, kind=f"{kind} (list)"
            )["items"]
        except KubeError as e:
            if e.status == 404:
                return []
            raise
        return items

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` as our field manager, taking over conflicting fields."""
        meta = obj["metadata"]
        out: dict[str, Any] = self.request(
            "PATCH",
            path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]),
            body=obj,
            query={"fieldManager": self.field_manager, "force": "true"},
            content_type="application/apply-patch+yaml",
            kind=obj["kind"],
        )
        return out

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        body: dict[str, Any],
        strategic: bool = False,
    ) -> dict[str, Any]:
        """JSON merge patch (RFC 7386; a ``metadata.resourceVersion`` in ``body`` guards it),
        or with ``strategic`` a strategic merge patch (lists merged by key, built-in kinds)."""
        out: dict[str, Any] = self.request(
            "PATCH",
            path(api_version, kind, namespace, name),
            body=body,
            content_type="application/strategic-merge-patch+json"
            if strategic
            else "application/merge-patch+json",
            kind=kind,
        )
        return out

    def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Merge-patch the status subresource; None if the object is gone."""
        try:
            out: dict[str, Any] = self.request(
                "PATCH",
                path(api_version, kind, namespace, name, "status"),
                body={"status": status},
                content_type="application/merge-patch+json",
                kind=f"{kind}/status",
            )
        except KubeError as e:
            if e.status == 404:
                return None
            raise
        return out

    def create(self, obj: dict[str, Any], exist_ok: bool = False) -> dict[str, Any] | None:
        """POST ``obj``; with ``exist_ok`` a 409 returns None instead of raising."""
        meta = obj["metadata"]
        try:
            out: dict[str, Any] = self.request(
                "POST",
                path(obj["apiVersion"], obj["kind"], meta["namespace"]),
                body=obj,
                query={"fieldManager": self.field_manager},
                kind=obj["kind"],
            )
        except KubeError as e:
            if exist_ok and e.status == 409:
                return None
            raise
        return out

    def delete(
        self, api_version: str, kind: str, namespace: str, name: str, missing_ok: bool = True
    ) -> None:
        """Delete with background propagation, so owned pods go with it."""
        try:
            self.request(
                "DELETE",
                path(api_version, kind, namespace, name),
                body={"propagationPolicy": "Background"},
                kind=kind,
            )
        except KubeError as e:
            if not (missing_ok and e.status == 404):
                raise

    @property
    def write_count(self) -> int:
        with self._lock:
            return sum(self.writes.values())
