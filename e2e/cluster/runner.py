"""Start and stop the local control plane; see the package docstring."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.processes import log_tail, start_group, stop_group

HERE = Path(__file__).resolve().parent
# The stock kwok stages we use (from the kwok module), plus our own pod-exit.
KWOK_STAGES = [
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-delete.yaml",
    # PVCs of the default "kwok-volume" StorageClass get a (fake) PV and bind.
    "volume/fast/pvc-provision.yaml",
    "volume/fast/pv-bind.yaml",
    "volume/fast/pv-delete.yaml",
    "volume/fast/pvc-delete.yaml",
]
STORAGE_CLASS = "volume/fast/storage-class.yaml"
OPERATOR_USER = "encoderpool-operator"
# Every write is audited, and every request of the operator's user and of
# ServiceAccounts (reads too), so tests can see what a client really uses.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "users": ["encoderpool-operator"]},
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None", "verbs": ["get", "list", "watch"]},
        {"level": "Metadata"},
    ],
}
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
# Set on a Running pod to end it; see stages/pod-exit.yaml.
EXIT_CODE_ANNOTATION = "kwok.encoderpool.io/exit-code"
TERMINATION_MESSAGE_ANNOTATION = "kwok.encoderpool.io/termination-message"
# What a kubelet keeps of a termination message (the file's last bytes).
TERMINATION_MESSAGE_LIMIT = 4096
COMPONENTS = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"]


def bin_dir() -> Path:
    """The built binaries: $ENCODERPOOL_BIN, else what build.sh prints (building if needed)."""
    if env := os.environ.get("ENCODERPOOL_BIN"):
        return Path(env)
    out = subprocess.run(
        [str(HERE / "build.sh")], check=True, capture_output=True, text=True
    ).stdout
    return Path(out.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """CA, apiserver serving cert for 127.0.0.1, admin client cert, SA signing key."""
    d.mkdir(parents=True, exist_ok=True)
    if (d / "done").exists():
        return
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "3650", "-subj", "/CN=encoderpool-test-ca", cwd=d)  # fmt: skip
    san = (
        "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,"
        "DNS:kubernetes.default.svc.cluster.local\n"
        "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    )
    client = "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    (d / "server.ext").write_text(san)
    (d / "client.ext").write_text(client)
    for name, subj, ext in [
        ("apiserver", "/CN=kube-apiserver", "server.ext"),
        ("admin", "/O=system:masters/CN=admin", "client.ext"),
        # The operator under test gets a user of its own, so the audit log tells
        # its requests from the test's (see LocalCluster.audit_events).
        (OPERATOR_USER, f"/O=system:masters/CN={OPERATOR_USER}", "client.ext"),
    ]:
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", "-subj", subj, cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "3650", "-out", f"{name}.crt",
                 "-extfile", ext, cwd=d)  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    for key in d.glob("*.key"):
        key.chmod(0o600)
    (d / "done").touch()


def write_kubeconfig(
    path: Path,
    server: str,
    ca: Path,
    user: str,
    credentials: dict[str, str],
    namespace: str | None = None,
) -> Path:
    """A one-context kubeconfig (JSON is YAML: kubectl, the Python client and kopf read it)."""
    context: dict[str, str] = {"cluster": "local", "user": user}
    if namespace:
        context["namespace"] = namespace
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "local", "context": context}],
        "current-context": "local",
    }
    path.write_text(json.dumps(config, indent=1))
    path.chmod(0o600)
    return path


def cert_credentials(pki: Path, user: str) -> dict[str, str]:
    return {"client-certificate": str(pki / f"{user}.crt"), "client-key": str(pki / f"{user}.key")}


@dataclass
class LocalCluster:
    """One control plane under ``state``; every process is ours, stopped by PID."""

    state: Path
    bins: Path = field(default_factory=bin_dir)
    nodes: int = 2
    port: int = field(default_factory=_free_port)
    # Extra kube-controller-manager flags (the scale benchmark lifts its client limits).
    controller_manager_args: tuple[str, ...] = ()
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def kubeconfig(self) -> Path:
        return self.state / "admin.kubeconfig"

    @property
    def operator_kubeconfig(self) -> Path:
        """Kubeconfig of the user ``encoderpool-operator`` (cluster-admin, audited apart)."""
        return self.state / "operator.kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.state / "audit.log"

    def audit_events(
        self,
        user: str | None = OPERATOR_USER,
        namespace: str | None = None,
        writes_only: bool = True,
    ) -> list[Any]:
        """Requests by ``user`` (None: anyone; optionally in ``namespace``) so far, oldest first.

        Reads are recorded only for the operator's user and ServiceAccounts.
        """
        events: list[Any] = []
        if not self.audit_log.exists():
            return events
        for line in self.audit_log.read_text().splitlines():
            event = json.loads(line)
            if event.get("stage") not in ("ResponseComplete", "ResponseStarted"):
                continue
            if writes_only and event.get("verb") not in WRITE_VERBS:
                continue
            if user is not None and event.get("user", {}).get("username") != user:
                continue
            if namespace and event.get("objectRef", {}).get("namespace") != namespace:
                continue
            events.append(event)
        return events

    @property
    def pki(self) -> Path:
        return self.state / "pki"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _run(self, name: str, *args: str) -> None:
        proc = start_group([str(self.bins / name), *args], os.environ, self.state / f"{name}.log")
        self.procs[name] = proc
        (self.state / f"{name}.pid").write_text(str(proc.pid))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        """Run the built kubectl against this cluster as admin; returns stdout."""
        res = subprocess.run(
            [str(self.bins / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and res.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {res.stderr.strip()}")
        return res.stdout

    def wait_established(self, crd: str, timeout: float = 60.0) -> None:
        """Until the CRD's Established condition is True. (``kubectl wait`` fails outright
        when it reads the CRD before the server has written any condition: seen in CI.)"""
        deadline = time.monotonic() + timeout
        while True:
            obj = json.loads(self.kubectl("get", "crd", crd, "-o", "json"))
            conditions = obj.get("status", {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {crd} not Established after {timeout:.0f}s: {conditions}")
            time.sleep(0.2)

    def start(self, timeout: float = 120.0) -> LocalCluster:
        self.state.mkdir(parents=True, exist_ok=True)
        make_pki(self.pki)
        ca = self.pki / "ca.crt"
        for path, user in ((self.kubeconfig, "admin"), (self.operator_kubeconfig, OPERATOR_USER)):
            write_kubeconfig(path, self.server, ca, user, cert_credentials(self.pki, user))
        (self.state / "audit-policy.json").write_text(json.dumps(AUDIT_POLICY))
        etcd_port, peer_port = _free_port(), _free_port()
        p = self.pki
        self._run(
            "etcd",
            "--data-dir", str(self.state / "etcd"), "--unsafe-no-fsync",
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
            "--listen-metrics-urls", f"http://127.0.0.1:{_free_port()}",
        )  # fmt: skip
        self._run(
            "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--tls-cert-file={p}/apiserver.crt", f"--tls-private-key-file={p}/apiserver.key",
            f"--client-ca-file={p}/ca.crt",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={p}/sa.pub",
            f"--service-account-signing-key-file={p}/sa.key",
            "--service-cluster-ip-range=10.0.0.0/16",  # the scale benchmark needs >254 IPs
            "--authorization-mode=RBAC",
            # kwok pods get no token volume; the plugin would also race the
            # controller that creates each namespace's default ServiceAccount.
            "--disable-admission-plugins=ServiceAccount",
            "--enable-priority-and-fairness=false",
            f"--audit-policy-file={self.state / 'audit-policy.json'}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
            # Never rotated (0 means lumberjack's 100 MB): callers index into one file.
            "--audit-log-maxsize=1000000",
        )  # fmt: skip
        self._wait("kube-apiserver ready", lambda: self._readyz(), timeout)
        self._run(
            "kube-controller-manager",
            f"--kubeconfig={self.kubeconfig}", "--bind-address=127.0.0.1", "--secure-port=0",
            "--leader-elect=false", f"--service-account-private-key-file={p}/sa.key",
            f"--root-ca-file={p}/ca.crt", f"--cluster-signing-cert-file={p}/ca.crt",
            f"--cluster-signing-key-file={p}/ca.key",
            "--concurrent-gc-syncs=5", "--node-monitor-grace-period=60s",
            *self.controller_manager_args,
        )  # fmt: skip
        self._run(
            "kube-scheduler",
            f"--kubeconfig={self.kubeconfig}", "--bind-address=127.0.0.1", "--secure-port=0",
            "--leader-elect=false",
        )  # fmt: skip
        stages = [str(self.bins / "kwok-stages" / s) for s in KWOK_STAGES]
        stages.append(str(HERE / "stages" / "pod-exit.yaml"))
        self._run(
            "kwok",
            f"--kubeconfig={self.kubeconfig}", "--manage-all-nodes=true",
            "--node-ip=127.0.0.1", "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{_free_port()}",
            *[f"--config={s}" for s in stages],
        )  # fmt: skip
        self.kubectl("apply", "-f", str(self.bins / "kwok-stages" / STORAGE_CLASS))
        for i in range(self.nodes):
            self.kubectl("apply", "-f", "-", input=json.dumps(_node(f"kwok-node-{i}")))
        self.kubectl("wait", "--for=condition=Ready", "node", "--all", f"--timeout={int(timeout)}s")
        # A namespace's "default" ServiceAccount appears once the controller runs.
        self._wait(
            "default ServiceAccount",
            lambda: self.kubectl("get", "sa", "default", "-n", "default", check=False) != "",
            timeout,
        )
        return self

    def finish_pod(self, namespace: str, name: str, exit_code: int, message: str = "") -> None:
        """Play kubelet for a Job's pod: kwok marks it Succeeded (0) or Failed (other).

        ``message`` becomes each container's ``state.terminated.message``, as a
        kubelet reports what the container left in its terminationMessagePath.
        """
        annotations = [f"{EXIT_CODE_ANNOTATION}={exit_code}"]
        if message:  # one request, so kwok never sees the exit code without the message
            annotations.insert(0, f"{TERMINATION_MESSAGE_ANNOTATION}={message}")
        self.kubectl("annotate", "pod", name, "-n", namespace, "--overwrite", *annotations)

    def _readyz(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
        res = subprocess.run(
            [str(self.bins / "kubectl"), "--kubeconfig", str(self.kubeconfig),
             "get", "--raw=/readyz"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        return res.returncode == 0

    def _wait(self, what: str, ok: object, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():  # type: ignore[operator]
                return
            time.sleep(0.3)
        raise TimeoutError(
            f"local cluster: {what} not reached in {timeout:.0f}s; logs in {self.state}"
        )

    def log_tail(self, name: str, lines: int = 40) -> str:
        return log_tail(self.state / f"{name}.log", lines)

    def stop(self) -> None:
        """SIGTERM each process group we started (reverse order), then SIGKILL."""
        for name in reversed(COMPONENTS):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            stop_group(proc, 15)
            (self.state / f"{name}.pid").unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_from_pidfiles(state: Path) -> None:
    """Stop a cluster started by another process (``python -m e2e.cluster down``)."""
    for name in reversed(COMPONENTS):
        pidfile = state / f"{name}.pid"
        if not pidfile.exists():
            continue
        pid = int(pidfile.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        pidfile.unlink()


def _node(name: str) -> dict[str, object]:
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"type": "kwok", "kubernetes.io/hostname": name},
            "annotations": {"kwok.x-k8s.io/node": "fake"},
        },
        "status": {"allocatable": capacity, "capacity": capacity},
    }
