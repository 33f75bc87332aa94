"""A kind cluster running the pool's real images, driven the way a user drives one.

Everything goes through the same scripts a person runs: ``tools/dockerd.sh`` (our
own engine, egress guard first), ``docker/build.sh`` (images, offline, cached by
content), ``e2e/kind/up.sh`` / ``down.sh``, ``docker push`` to the cluster's
registry, ``helm`` and ``kubectl`` against the cluster's API on 127.0.0.1. Nothing
here talks to a pod or Service IP: requests reach pods through ``kubectl
port-forward`` only.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KIND_DIR = ROOT / "e2e" / "kind"
CHART = ROOT / "charts" / "encoderpool-operator"
OPERATOR_NS = "encoderpool-system"
RELEASE = "encoderpool"
# The host-global sysctls a kind node's kubelet (and Debian's sysctl.d in the node) would
# change; the node image shields them, and tests check the host's values are unchanged.
HOST_SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "fs.protected_hardlinks",
    "fs.protected_symlinks",
    "fs.protected_fifos",
    "fs.protected_regular",
    "kernel.pid_max",
    "net.ipv4.ip_forward",
)


def host_sysctls() -> dict[str, str]:
    """The host's current values of ``HOST_SYSCTLS`` (read from /proc/sys)."""
    out = {}
    for key in HOST_SYSCTLS:
        path = Path("/proc/sys") / key.replace(".", "/")
        with contextlib.suppress(FileNotFoundError):
            out[key] = path.read_text().strip()
    return out


def run(
    argv: Sequence[str | Path],
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    check: bool = True,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure raise with its output, so the reason is in the report."""
    proc = subprocess.run(
        [str(a) for a in argv],
        env=dict(env) if env is not None else None,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(str(a) for a in argv[:6])} ... exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
        )
    return proc


def key_values(text: str) -> dict[str, str]:
    """``KEY=value`` lines a script printed (its last lines), as a dict."""
    return dict(line.split("=", 1) for line in text.splitlines() if re.match(r"^[A-Z_]+=", line))


@dataclass
class Engine:
    """Our dockerd: started if nothing answers, stopped (by its PID file) if we started it."""

    host: str
    started: bool

    @classmethod
    def ensure(cls) -> Engine:
        host = run([ROOT / "tools" / "dockerd.sh", "host"]).stdout.strip()
        answering = run(["docker", "version"], env={**os.environ, "DOCKER_HOST": host}, check=False)
        if answering.returncode == 0:
            run([ROOT / "tools" / "egress-guard.sh", "--check"])
            return cls(host, started=False)
        run([ROOT / "tools" / "dockerd.sh", "start"], timeout=900)
        return cls(host, started=True)

    def stop(self) -> None:
        if self.started:
            run([ROOT / "tools" / "dockerd.sh", "stop"], check=False)


@dataclass
class Images:
    """What docker/build.sh built (or found cached): image references."""

    base: str
    operator: str
    vllm: str

    @classmethod
    def build(cls, env: Mapping[str, str]) -> Images:
        out = key_values(run([ROOT / "docker" / "build.sh"], env=env, timeout=3600).stdout)
        return cls(base=out["BASE_IMAGE"], operator=out["OPERATOR_IMAGE"], vllm=out["VLLM_IMAGE"])


@dataclass
class KindCluster:
    """One kind cluster; ``kubectl``/``helm`` run with its kubeconfig, from our bin dir."""

    name: str
    kubeconfig: Path
    share: Path
    registry: str
    env: dict[str, str]
    bin: Path

    @classmethod
    def up(cls, name: str, engine: Engine, bin_dir: Path) -> KindCluster:
        env = {**os.environ, "DOCKER_HOST": engine.host}
        out = key_values(run([KIND_DIR / "up.sh", name], env=env, timeout=3600).stdout)
        if out.get("PATH_PREFIX"):
            env["PATH"] = out["PATH_PREFIX"] + os.pathsep + env["PATH"]
        env["KUBECONFIG"] = out["KUBECONFIG"]
        return cls(
            name,
            Path(out["KUBECONFIG"]),
            Path(out["KIND_SHARE"]),
            out["KIND_REGISTRY"],
            env,
            bin_dir,
        )

    def down(self) -> None:
        run([KIND_DIR / "down.sh", self.name], env=self.env, check=False)

    def push(self, image: str) -> str:
        """Push a local image to the cluster's registry; returns the name pods pull. Only
        layers the registry lacks are sent, and the node pulls only layers it lacks."""
        ref = f"{self.registry}/{image.split('/', 1)[1]}"
        run(["docker", "tag", image, ref], env=self.env)
        run(["docker", "push", ref], env=self.env, timeout=3600)
        repo = ref.rsplit(":", 1)[0]
        tags = run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}", repo], env=self.env)
        stale = [t for t in tags.stdout.split() if t != ref]
        if stale:  # older pushes of this repository: untag them locally
            run(["docker", "rmi", *stale], env=self.env, check=False)
        return ref

    def push_images(self, images: Images) -> Images:
        return Images(
            base=images.base, operator=self.push(images.operator), vllm=self.push(images.vllm)
        )

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 600
    ) -> str:
        proc = run(
            [self.bin / "kubectl", *args], env=self.env, input=input, check=check, timeout=timeout
        )
        return proc.stdout

    def helm(self, *args: str, timeout: float = 900) -> str:
        return run([self.bin / "helm", *args], env=self.env, timeout=timeout).stdout

    def install_operator(self, images: Images, *values: str) -> None:
        """``helm upgrade --install`` of the chart with our operator image, one replica (the
        node has 2 cores); ``values`` are more ``--set`` assignments."""
        repo, tag = images.operator.rsplit(":", 1)
        sets = [f"image.repository={repo}", f"image.tag={tag}", "image.pullPolicy=IfNotPresent",
                "replicaCount=1", *values]  # fmt: skip
        self.helm(
            "upgrade",
            "--install",
            RELEASE,
            str(CHART),
            "-n",
            OPERATOR_NS,
            "--create-namespace",
            *(a for v in sets for a in ("--set", v)),
            "--wait",
            "--timeout",
            "5m",
        )

    def apply(
        self, obj: Mapping[str, Any] | Sequence[Mapping[str, Any]], namespace: str | None = None
    ) -> None:
        items = [obj] if isinstance(obj, Mapping) else list(obj)
        doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        ns = ["-n", namespace] if namespace else []
        self.kubectl("apply", *ns, "-f", "-", input=doc)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", "-o", "json", *args))

    def node_exec(self, *cmd: str, timeout: float = 120) -> str:
        """Run ``cmd`` on the node (its container, as root), e.g. to mount or fill a volume."""
        return run(
            ["docker", "exec", f"{self.name}-control-plane", *cmd], env=self.env, timeout=timeout
        ).stdout

    def namespace(self, name: str) -> None:
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    @contextlib.contextmanager
    def port_forward(self, namespace: str, target: str, port: int) -> Iterator[str]:
        """``kubectl port-forward`` to 127.0.0.1 (a free local port); yields the base URL."""
        proc = subprocess.Popen(
            [
                str(self.bin / "kubectl"),
                "port-forward",
                "-n",
                namespace,
                "--address",
                "127.0.0.1",
                target,
                f":{port}",
            ],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            m = re.search(r"127\.0\.0\.1:(\d+)", line)
            if not m:
                raise RuntimeError(
                    f"port-forward to {namespace}/{target}: {line}{proc.stdout.read(2000)}"
                )
            # kubectl prints a line per connection: unread, they fill the pipe (64 KiB,
            # some 2,000 connections) and kubectl blocks, and so does every connection.
            threading.Thread(target=collections.deque, args=(proc.stdout, 0), daemon=True).start()
            yield f"http://127.0.0.1:{m.group(1)}"
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            proc.kill()

    def diagnose(self, namespaces: Sequence[str]) -> str:
        """What a failed test prints: pods, events, and the logs of every pod not Ready."""
        parts = [self.kubectl("get", "pods", "-A", "-o", "wide", check=False)]
        for ns in namespaces:
            parts.append(f"===== events in {ns}")
            parts.append(
                self.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False)[
                    -6000:
                ]
            )
            parts.append(self.kubectl("get", "epool", "-n", ns, "-o", "yaml", check=False)[-6000:])
            pods = json.loads(
                self.kubectl("get", "pods", "-n", ns, "-o", "json", check=False) or '{"items": []}'
            )
            for pod in pods["items"]:
                ready = any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in pod.get("status", {}).get("conditions", [])
                )
                if ready and pod["status"].get("phase") != "Failed":
                    continue
                name = pod["metadata"]["name"]
                parts.append(f"===== pod {ns}/{name} ({pod['status'].get('phase')}): describe")
                parts.append(self.kubectl("describe", "pod", "-n", ns, name, check=False)[-4000:])
                parts.append(f"===== pod {ns}/{name}: logs")
                parts.append(
                    self.kubectl(
                        "logs", "-n", ns, name, "--all-containers", "--tail=80", check=False
                    )
                )
        return "\n".join(parts)


def copy_model(model: Path, share: Path, name: str) -> Path:
    """Put the model where the node sees it (``/var/lib/encoderpool/models/<name>``), readable
    by the pods' uid 1000: that folder backs the model PersistentVolume."""
    dest = share / "models" / name
    if not dest.exists():
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(model, tmp)
        for p in [tmp, *tmp.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        tmp.rename(dest)
    return dest
