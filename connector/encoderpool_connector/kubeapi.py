"""A tiny Kubernetes API client on the standard library, for the width Job.

The Job runs in the vLLM image, which has neither the Kubernetes client nor
kopf. It needs one call: server-side apply of a ConfigMap. Credentials come
from the pod's service account (in cluster) or a kubeconfig (local runs:
client certificate and key, or a bearer token). Tokens are never logged.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import ssl
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
FIELD_MANAGER = "encoderpool-measure"


class KubeAPIError(RuntimeError):
    """An API call failed; ``status`` is the HTTP status (0 when the server was unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class KubeAPI:
    server: str
    ssl_context: ssl.SSLContext | None
    headers: dict[str, str] = field(default_factory=dict, repr=False)  # may hold a token

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None) -> KubeAPI:
        """A kubeconfig if given (or $KUBECONFIG), else the pod's service account."""
        path = kubeconfig or os.environ.get("KUBECONFIG")
        if path:
            return cls.from_kubeconfig(Path(path))
        if os.environ.get("KUBERNETES_SERVICE_HOST") and (SA_DIR / "token").is_file():
            return cls.in_cluster()
        default = Path.home() / ".kube" / "config"
        if default.is_file():
            return cls.from_kubeconfig(default)
        raise ValueError(
            "no Kubernetes credentials: not in a pod (KUBERNETES_SERVICE_HOST unset) and no "
            "kubeconfig (pass --kubeconfig or set KUBECONFIG)"
        )

    @classmethod
    def in_cluster(cls) -> KubeAPI:
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if ":" in host:
            host = f"[{host}]"
        ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        token = (SA_DIR / "token").read_text().strip()
        return cls(f"https://{host}:{port}", ctx, {"Authorization": f"Bearer {token}"})

    @classmethod
    def from_kubeconfig(cls, path: Path) -> KubeAPI:
        try:
            cfg: Any = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"kubeconfig {path}: cannot read it: {e}") from None
        try:
            ctx_name = cfg["current-context"]
            context = _named(cfg["contexts"], ctx_name, "context")
            cluster = _named(cfg["clusters"], context["cluster"], "cluster")
            user = _named(cfg.get("users") or [], context.get("user", ""), "user", optional=True)
        except (KeyError, TypeError) as e:
            raise ValueError(f"kubeconfig {path}: missing {e}") from None
        base = path.parent
        server = str(cluster["server"]).rstrip("/")
        ctx: ssl.SSLContext | None = None
        if server.startswith("https://"):
            ctx = ssl.create_default_context()
            if cluster.get("insecure-skip-tls-verify"):
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            elif "certificate-authority-data" in cluster:
                ctx.load_verify_locations(
                    cadata=base64.b64decode(cluster["certificate-authority-data"]).decode()
                )
            elif "certificate-authority" in cluster:
                ctx.load_verify_locations(cafile=str(base / cluster["certificate-authority"]))
        headers: dict[str, str] = {}
        if user.get("token"):
            headers["Authorization"] = f"Bearer {user['token']}"
        elif user.get("tokenFile"):
            token = (base / user["tokenFile"]).read_text().strip()
            headers["Authorization"] = f"Bearer {token}"
        if ctx is not None and ("client-certificate" in user or "client-certificate-data" in user):
            with (
                _pem(user, "client-certificate", base) as cert,
                _pem(user, "client-key", base) as key,
            ):
                ctx.load_cert_chain(cert, key)
        return cls(server, ctx, headers)

    def request(self, method: str, path: str, body: bytes | None, content_type: str) -> Any:
        if not self.server.startswith(("https://", "http://")):
            raise ValueError(f"kubeconfig server {self.server!r} is not an http(s) URL")
        req = urllib.request.Request(  # noqa: S310  # scheme checked above
            self.server + path,
            data=body,
            method=method,
            headers={"Content-Type": content_type, "Accept": "application/json", **self.headers},
        )
        try:
            # The URL is the configured API server, never user input.
            with urllib.request.urlopen(req, timeout=30, context=self.ssl_context) as r:  # noqa: S310
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise KubeAPIError(e.code, f"{method} {path}: {_status_message(e)}") from None
        except (urllib.error.URLError, OSError) as e:
            raise KubeAPIError(0, f"{method} {path}: cannot reach {self.server}: {e}") from None

    def apply(self, path: str, obj: dict[str, Any], field_manager: str = FIELD_MANAGER) -> Any:
        """Server-side apply (force: this manager owns what it writes)."""
        query = urllib.parse.urlencode({"fieldManager": field_manager, "force": "true"})
        body = json.dumps(obj).encode()  # JSON is YAML
        return self.request("PATCH", f"{path}?{query}", body, "application/apply-patch+yaml")

    def apply_configmap(
        self, namespace: str, name: str, data: dict[str, str], labels: dict[str, str]
    ) -> Any:
        obj = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "data": data,
        }
        ns, nm = urllib.parse.quote(namespace, safe=""), urllib.parse.quote(name, safe="")
        return self.apply(f"/api/v1/namespaces/{ns}/configmaps/{nm}", obj)


def _named(items: Any, name: str, what: str, optional: bool = False) -> dict[str, Any]:
    for item in items or []:
        if item.get("name") == name:
            return dict(item.get(what) or {})
    if optional:
        return {}
    raise KeyError(f"{what} {name!r}")


@contextlib.contextmanager
def _pem(user: dict[str, Any], key: str, base: Path) -> Iterator[str]:
    """A file path for a PEM given inline (``*-data``) or by path; inline data lives briefly."""
    if f"{key}-data" not in user:
        yield str(base / user[key])
        return
    fd, path = tempfile.mkstemp(suffix=".pem")
    try:
        os.write(fd, base64.b64decode(user[f"{key}-data"]))
        os.close(fd)
        yield path
    finally:
        os.unlink(path)


def _status_message(e: urllib.error.HTTPError) -> str:
    try:
        status = json.loads(e.read())
        return f"{e.code} {status.get('reason', '')}: {status.get('message', '')}"
    except (ValueError, OSError):
        return f"{e.code} {e.reason}"
