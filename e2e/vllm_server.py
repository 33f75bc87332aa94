"""Start and stop real ``vllm serve`` processes on loopback for tests, demo and benchmarks.

Each server gets a free 127.0.0.1 port, its own log file and environment, runs
in its own process group (so the API server, engine core and workers stop
together, by PID), and is ready when ``/health`` answers 200.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.media import MODEL
from e2e.processes import log_tail, start_group, stop_group, stop_groups, wait_healthy

REPO = Path(__file__).resolve().parent.parent

# Small enough for two instances on a 2-core, 24 GiB machine.
BASE_ARGS = [
    "--dtype", "bfloat16",
    "--max-model-len", "2048",
    "--max-num-seqs", "4",
    "--max-num-batched-tokens", "2048",
    "--kv-cache-memory-bytes", str(128 * 1024 * 1024),
    "--enforce-eager",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(cpu: str | None = None) -> dict[str, str]:
    """The environment vLLM needs here: offline, CPU platform, our packages importable."""
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override --kv-cache-memory-bytes
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_TARGET_DEVICE="cpu",
        PYTHONUNBUFFERED="1",
    )
    # One hash seed for an engine's spawned workers, as the operator renders for TP > 1
    # pods (render.pod.hash_seed): vLLM orders the start-up width measurement by a set.
    env.setdefault("PYTHONHASHSEED", "0")
    paths = [str(REPO / p) for p in ("contracts", "connector", "operator")] + [str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if cpu is not None:
        # The default binds every instance to core 0; pin each to its own.
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    return env


def tensor_parallel(size: int) -> tuple[list[str], dict[str, str]]:
    """Args and env of a CPU server whose engine spans ``size`` tensor-parallel ranks, one
    core each (vLLM CPU refuses TP without a per-rank binding). Ranks need the
    multiprocess executor; their all-reduces go over gloo on this machine."""
    if size == 1:
        return [], {}
    args = ["--tensor-parallel-size", str(size), "--distributed-executor-backend", "mp"]
    return args, {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(size))}


def ec_transfer_config(
    connector: str, role: str, extra: Mapping[str, Any], module: str | None = None
) -> str:
    """The ``--ec-transfer-config`` JSON for one role."""
    cfg: dict[str, Any] = {
        "ec_connector": connector,
        "ec_role": role,
        "ec_connector_extra_config": dict(extra),
    }
    if module:
        cfg["ec_connector_module_path"] = module
    return json.dumps(cfg)


@dataclass
class VllmServer:
    """One ``vllm serve`` process (group) on 127.0.0.1."""

    name: str
    model: Path
    log_path: Path
    args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=base_env)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        vllm = Path(sys.executable).parent / "vllm"
        return [
            str(vllm), "serve", str(self.model),
            "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(self.port),
            *BASE_ARGS, *self.args,
        ]  # fmt: skip

    def start(self) -> VllmServer:
        self.proc = start_group(self.command(), self.env, self.log_path)
        return self

    def wait_ready(self, timeout: float = 240.0) -> VllmServer:
        assert self.proc is not None, "start() first"
        wait_healthy(
            self.proc, self.url + "/health", f"vLLM server {self.name}", self.log_path, timeout
        )
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group we started, then SIGKILL what is left."""
        if self.proc is not None:
            stop_group(self.proc, timeout)

    def log_tail(self, lines: int = 80) -> str:
        return log_tail(self.log_path, lines)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: Mapping[str, Any], timeout: float = 300.0) -> Any:
        return post_json(self.url + path, body, timeout)

    def chat(self, body: Mapping[str, Any], timeout: float = 300.0) -> Any:
        return self.post("/v1/chat/completions", body, timeout)


def post_json(
    url: str,
    body: Mapping[str, Any],
    timeout: float = 300.0,
    headers: Mapping[str, str] | None = None,
) -> Any:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url} -> {e.code}: {e.read()[:2000]!r}") from e


@contextlib.contextmanager
def running(*servers: VllmServer, timeout: float = 300.0) -> Iterator[tuple[VllmServer, ...]]:
    """Start servers together (they load in parallel), wait for all, stop all."""
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout)
        yield servers
    finally:
        stop_all(servers)


def stop_all(servers: Iterable[VllmServer], timeout: float = 30.0) -> None:
    """Stop servers together: their shutdowns overlap instead of queueing."""
    stop_groups([s.proc for s in servers if s.proc is not None], timeout)
