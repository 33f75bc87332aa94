"""Run the operator (``kopf run``) as a local process against a cluster, stopped by PID."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from e2e.processes import log_tail, start_group, stop_group
from e2e.vllm_server import free_port

REPO = Path(__file__).resolve().parent.parent


@dataclass
class OperatorProcess:
    """One operator watching ``namespace`` (or all namespaces when None)."""

    kubeconfig: Path
    log_path: Path
    namespace: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> OperatorProcess:
        """Start it. Unless ``env`` names a Lease (ENCODERPOOL_LEASE_NAME), each start gets
        a Lease of its own, so a restart after a kill leads at once instead of waiting out
        its previous life's lease; tests of leadership name one Lease for several. The
        Lease is in ``default`` unless ``env`` says otherwise: its renewals (a write every
        2 s) stay out of the watched namespace, where tests count the operator's writes."""
        scope = ["--namespace", self.namespace] if self.namespace else ["--all-namespaces"]
        env = {
            "ENCODERPOOL_LEASE_NAME": f"encoderpool-operator-{uuid.uuid4().hex[:8]}",
            "ENCODERPOOL_LEASE_NAMESPACE": "default",
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "ENCODERPOOL_KUBECONFIG": str(self.kubeconfig),
            "PYTHONPATH": os.pathsep.join(
                [str(REPO / p) for p in ("contracts", "operator", "connector")] + [str(REPO)]
            ),
            "PYTHONUNBUFFERED": "1",
            "ENCODERPOOL_METRICS_PORT": str(self.metrics_port),
            "ENCODERPOOL_METRICS_ADDRESS": "127.0.0.1",
            **self.env,
        }
        argv = [sys.executable, "-m", "kopf", "run", "--standalone", "--verbose",
                "-m", "encoderpool_operator.handlers", *scope]  # fmt: skip
        self.proc = start_group(argv, env, self.log_path)
        return self

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL, to test a crash) the process group we started."""
        if self.proc is not None:
            stop_group(self.proc, kill=kill)
        self.proc = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)
