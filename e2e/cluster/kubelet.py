"""Play kubelet for chosen pods: run a pod's container command as a local process.

kwok makes pods Running but runs nothing. When a test needs what a pod would
do (the width Job's pod measuring a real model), this runs the pod's own
command, args and env on this machine, with the credentials the pod would
have: its ServiceAccount's (a TokenRequest token in a kubeconfig, so its RBAC
is what is tested), or none at all where the pod does not mount a token. The
container's terminationMessagePath maps to a local file; afterwards the exit
code and what the file holds (its last 4096 bytes, as a kubelet keeps) go to
kwok, which moves the pod to Succeeded or Failed with that termination message
for the Job controller and the operator to see.

Secrets reach the process as a kubelet would hand them to the container: an env
``valueFrom.secretKeyRef`` becomes the key's value, a ``secret`` volume becomes
a local directory of its keys (the mount path rewritten to it). The stand-in
reads them with the cluster's admin credentials, as a kubelet reads with its own.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.cluster.runner import (
    EXIT_CODE_ANNOTATION,
    TERMINATION_MESSAGE_LIMIT,
    LocalCluster,
    write_kubeconfig,
)
from e2e.processes import start_group, stop_group, wait_healthy

DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"
# With FallbackToLogsOnError a kubelet reports the log's tail (80 lines, 2048 bytes).
FALLBACK_LINES, FALLBACK_BYTES = 80, 2048


@dataclass(frozen=True)
class PodRun:
    pod: str
    argv: list[str]
    returncode: int
    output: str
    termination_message: str = ""


def termination_message(
    container: dict[str, Any], message_file: Path, returncode: int, output: str
) -> str:
    """What a kubelet would report as ``state.terminated.message`` for this container."""
    text = ""
    if message_file.exists():
        with message_file.open("rb") as f:  # the kubelet keeps the file's last bytes
            f.seek(max(0, message_file.stat().st_size - TERMINATION_MESSAGE_LIMIT))
            text = f.read().decode(errors="replace")
    fallback = container.get("terminationMessagePolicy") == "FallbackToLogsOnError"
    if not text and returncode != 0 and fallback:
        tail = "\n".join(output.splitlines()[-FALLBACK_LINES:])
        text = tail.encode()[-FALLBACK_BYTES:].decode(errors="replace")
    return text


def automounts_token(pod: dict[str, Any]) -> bool:
    """Whether the pod gets a ServiceAccount token (the pod's field; default yes)."""
    return bool(pod["spec"].get("automountServiceAccountToken", True))


def service_account_kubeconfig(
    cluster: LocalCluster, namespace: str, service_account: str, out: Path
) -> Path:
    """A kubeconfig that authenticates as ``namespace/service_account`` (TokenRequest)."""
    token = cluster.kubectl(
        "create", "token", service_account, "-n", namespace, "--duration=1h"
    ).strip()
    return write_kubeconfig(
        out, cluster.server, cluster.pki / "ca.crt", service_account, {"token": token}, namespace
    )


def local_argv(container: dict[str, Any]) -> list[str]:
    """The container's command, with ``python`` as this interpreter (it has the packages)."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv and argv[0] in {"python", "python3"}:
        argv[0] = sys.executable
    return argv


# (namespace, name) -> the Secret's data, decoded; None when there is no such Secret.
SecretReader = Callable[[str, str], dict[str, str] | None]


def secret_reader(cluster: LocalCluster) -> SecretReader:
    """Read Secrets as the kubelet would, with the cluster's admin credentials."""

    def read(namespace: str, name: str) -> dict[str, str] | None:
        out = cluster.kubectl(
            "get", "secret", name, "-n", namespace, "-o", "json", "--ignore-not-found"
        )
        if not out.strip():
            return None
        data = json.loads(out).get("data") or {}
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    return read


def _secret_key(
    secrets: SecretReader | None, namespace: str, ref: dict[str, Any], what: str
) -> str | None:
    """A secretKeyRef's value; None when optional and missing; otherwise a missing Secret or
    key is an error, as it keeps a real kubelet from starting the container."""
    data = secrets(namespace, ref["name"]) if secrets is not None else None
    if data is not None and ref["key"] in data:
        return data[ref["key"]]
    if ref.get("optional"):
        return None
    if secrets is None:
        raise RuntimeError(f"{what} needs Secret {ref['name']}: pass a secret reader")
    raise RuntimeError(
        f"{what}: Secret {namespace}/{ref['name']} or its key {ref['key']!r} is missing "
        "(a kubelet would not start the container: CreateContainerConfigError)"
    )


def local_env(
    pod: dict[str, Any], container: dict[str, Any], secrets: SecretReader | None = None
) -> dict[str, str]:
    """The container's literal env, the downward-API fields the operator uses, and
    secretKeyRef values (read through ``secrets``)."""
    env = dict(os.environ)
    env.pop("KUBERNETES_SERVICE_HOST", None)  # never in-cluster here: use the kubeconfig
    fields = {
        "metadata.namespace": pod["metadata"]["namespace"],
        "metadata.name": pod["metadata"]["name"],
        "status.podIP": "127.0.0.1",  # the pod runs here
    }
    namespace = pod["metadata"]["namespace"]
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = item["value"]
        elif ref := source.get("fieldRef"):
            env[item["name"]] = fields[ref["fieldPath"]]
        elif ref := source.get("secretKeyRef"):
            value = _secret_key(secrets, namespace, ref, f"env {item['name']}")
            if value is not None:
                env[item["name"]] = value
    return env


def secret_volumes(
    pod: dict[str, Any], container: dict[str, Any], secrets: SecretReader, root: Path
) -> dict[str, str]:
    """Write each ``secret`` volume the container mounts under ``root`` (its keys, or its
    ``items``, as files); returns mountPath -> local directory, for argument rewriting."""
    namespace = pod["metadata"]["namespace"]
    volumes = {v["name"]: v["secret"] for v in pod["spec"].get("volumes", []) if "secret" in v}
    out: dict[str, str] = {}
    for mount in container.get("volumeMounts", []):
        source = volumes.get(mount["name"])
        if source is None:
            continue
        data = secrets(namespace, source["secretName"])
        if data is None:
            raise RuntimeError(f"volume {mount['name']}: no Secret {source['secretName']}")
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        local = root / f"{pod['metadata']['name']}-{mount['name']}"
        local.mkdir(parents=True, exist_ok=True)
        for item in items:
            target = local / item["path"]
            target.write_text(data[item["key"]])
            target.chmod(0o600)
        out[mount["mountPath"]] = str(local)
    return out


def run_pods(
    cluster: LocalCluster,
    namespace: str,
    selector: str,
    workdir: Path,
    count: int = 1,
    timeout: float = 300.0,
    extra_env: dict[str, str] | None = None,
) -> list[PodRun]:
    """Wait for ``count`` Running pods matching ``selector``, run each once, report exits."""
    done: list[PodRun] = []
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(done) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(done)} of {count} pods ({selector}) ran in {timeout}s")
        pods = json.loads(
            cluster.kubectl(
                "get",
                "pods",
                "-n",
                namespace,
                "-l",
                selector,
                "--field-selector=status.phase=Running",
                "-o",
                "json",
            )
        )["items"]
        fresh = [
            p
            for p in pods
            if p["metadata"]["name"] not in seen
            and EXIT_CODE_ANNOTATION not in p["metadata"].get("annotations", {})
        ]
        if not fresh:
            time.sleep(0.5)
            continue
        pod = fresh[0]
        name = pod["metadata"]["name"]
        seen.add(name)
        container = pod["spec"]["containers"][0]
        env = local_env(pod, container, secret_reader(cluster))
        if automounts_token(pod):
            sa = pod["spec"].get("serviceAccountName", "default")
            env["KUBECONFIG"] = str(
                service_account_kubeconfig(cluster, namespace, sa, workdir / f"{name}.kubeconfig")
            )
        else:  # no token in the pod: no way to the API server here either
            env.pop("KUBECONFIG", None)
        env.update(extra_env or {})
        message_path = container.get("terminationMessagePath", DEFAULT_TERMINATION_MESSAGE_PATH)
        message_file = workdir / f"{name}.termination-log"
        message_file.unlink(missing_ok=True)
        argv = [a.replace(message_path, str(message_file)) for a in local_argv(container)]
        res = subprocess.run(
            argv,
            env=env,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=max(1.0, deadline - time.monotonic()),
        )
        output = res.stdout + res.stderr
        message = termination_message(container, message_file, res.returncode, output)
        done.append(PodRun(name, argv, res.returncode, output, message))
        cluster.finish_pod(namespace, name, res.returncode, message)
    return done


@dataclass
class LocalPod:
    """A long-running pod's container run here: its args with host, port and mounts mapped.

    ``rewrite`` maps in-pod strings to local ones (a volume's mountPath to a
    local directory, the listen address to 127.0.0.1) wherever they appear in
    an argument, JSON included; ``replace_flags`` swaps whole flags (the
    router's Service discovery for local URLs). With ``cluster``, secretKeyRef env
    and ``secret`` volumes are read from it (beside the log file for volumes).
    """

    pod: dict[str, Any]
    log_path: Path
    port: int
    rewrite: dict[str, str]
    env: dict[str, str]
    replace_flags: dict[str, list[str]] | None = None
    cluster: LocalCluster | None = None
    proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        container = self.pod["spec"]["containers"][0]
        argv = local_argv(container)
        if argv and argv[0] == "vllm":
            argv[0] = str(Path(sys.executable).parent / "vllm")
        out: list[str] = []
        skip = False
        for i, arg in enumerate(argv):
            if skip:
                skip = False
                continue
            if arg == "--port":
                out += ["--port", str(self.port)]
                skip = True
                continue
            if self.replace_flags and arg in self.replace_flags:
                out += self.replace_flags[arg]
                skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
                continue
            for old, new in self.rewrite.items():
                arg = arg.replace(old, new)
            out.append(arg)
        return out

    def start(self) -> LocalPod:
        container = self.pod["spec"]["containers"][0]
        secrets = secret_reader(self.cluster) if self.cluster is not None else None
        if secrets is not None:
            mounts = secret_volumes(self.pod, container, secrets, self.log_path.parent)
            self.rewrite = {**self.rewrite, **mounts}
        env = {**local_env(self.pod, container, secrets), **self.env}
        self.proc = start_group(self.argv(), env, self.log_path)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 300.0) -> None:
        assert self.proc is not None, "start() first"
        name = self.pod["metadata"]["name"]
        wait_healthy(self.proc, self.url + "/health", name, self.log_path, timeout)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, 30)
        self.proc = None
