"""Fixtures for the connector tests (registered in conftest.pytest_plugins).

Real-engine connector tests share servers (each start costs ~40 s of CPU on these
2-core machines, nearly all of it three Python processes importing vLLM):
``ep_servers`` per module, ``servers_for`` in a package's conftest.py per package;
both stop every server they started, by PID, when their scope ends.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import threading
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from e2e.vllm_server import VllmServer, base_env, ec_transfer_config, stop_all
from encoderpool_contracts import ConnectorConfig, ModelIdentity

CONNECTOR = "EncoderPoolSharedVolumeConnector"
MODULE = "encoderpool_connector.shared_volume"

# DEBUG for the model runner shows "Finish execute for mm hash X" whenever an
# instance runs its encoder: the proof that a consumer did not. Shared with the
# router and rdma fixtures.
LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "vllm": {
            "()": "vllm.logging_utils.NewLineFormatter",
            "format": "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(message)s",
        }
    },
    "handlers": {
        "vllm": {
            "class": "logging.StreamHandler",
            "formatter": "vllm",
            "level": "DEBUG",
            "stream": "ext://sys.stdout",
        }
    },
    "loggers": {
        "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
        "vllm.v1.worker.gpu_model_runner": {"level": "DEBUG"},
        "vllm.distributed.ec_transfer": {"level": "DEBUG"},
        "vllm.ext": {"level": "DEBUG"},
    },
}


# What the width Job reports for the tiny model with vLLM's default limits (both
# modalities measured: test_measure), so the operator renders both.
TINY_WIDTHS = {"image": 128, "video": 128}


def producer_widths(log: str) -> dict[str, int]:
    """The widths an EC producer's vLLM measured at start-up, from its log (in no fixed
    order there)."""
    found = re.search(r"EC producer encoder output widths: (\{[^}]*\})", log)
    assert found, "the producer logged no measured widths"
    return dict(ast.literal_eval(found.group(1)))


def metric(server: VllmServer, name: str) -> float:
    """Sum of a Prometheus counter over its label sets (0 when not exported yet)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


def tiny_fingerprint(model: Path, tensor_parallel_size: int = 1) -> str:
    """The fingerprint the servers compute for the tiny model as the test bed serves it."""
    import vllm

    return ModelIdentity(
        model=str(model),
        vllm_version=str(vllm.__version__),
        tensor_parallel_size=tensor_parallel_size,
    ).fingerprint()


def sv_config(root: Path, fingerprint: str, **settings: Any) -> dict[str, Any]:
    """A valid shared-volume ``ec_connector_extra_config``, as the operator renders it."""
    sv: dict[str, Any] = {"root": str(root), "capacity_bytes": 64 << 20, **settings}
    cfg = ConnectorConfig(
        transport="sharedVolume",
        model_fingerprint=fingerprint,
        encoder_output_widths=TINY_WIDTHS,
        shared_volume=sv,
    )
    return cfg.to_extra_config()


EpFactory = Callable[..., VllmServer]


class Servers:
    """Starts EP servers for one fixture scope and stops them all when it ends.

    Servers start without waiting (use ``.wait_ready()``); all log with the model
    runner at DEBUG. Logs stay in the scope's temp dir; their tails are printed when
    a test of the session has failed by the time the scope ends.
    """

    def __init__(self, tiny_model: Path, logs: Path, prefix: str) -> None:
        self.tiny_model, self.logs, self.prefix = tiny_model, logs, prefix
        self.log_config = logs / "logging.json"
        self.log_config.write_text(json.dumps(LOGGING_CONFIG))
        self.started: list[VllmServer] = []

    def __call__(
        self,
        name: str,
        *,
        role: str | None = None,
        extra: dict[str, Any] | None = None,
        connector: str = CONNECTOR,
        module: str | None = MODULE,
        env: dict[str, str] | None = None,
        start: bool = True,
        args: Sequence[str] = (),
    ) -> VllmServer:
        """``args`` go before the EC config (e.g. ``e2e.vllm_server.tensor_parallel``'s)."""
        cmd = list(args)
        if role is not None:
            cmd += [
                "--ec-transfer-config",
                ec_transfer_config(connector, role, extra or {}, module),
            ]
        server = VllmServer(
            name=name,
            model=self.tiny_model,
            log_path=self.logs / f"{self.prefix}-{name}.log",
            args=cmd,
            env={
                **base_env(str(len(self.started) % 2)),
                "VLLM_LOGGING_CONFIG_PATH": str(self.log_config),
                **(env or {}),
            },
        )
        self.started.append(server)
        return server.start() if start else server

    def stop(self, show_logs: bool) -> None:
        stop_all(self.started)
        for server in self.started if show_logs else ():
            print(f"\n===== log of vLLM server {server.name} ({server.log_path}) =====")
            print(server.log_tail(60))


@contextlib.contextmanager
def servers_for(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    """A ``Servers`` for the requesting fixture's scope, stopped when it ends. A package's
    servers come from a fixture in that package's conftest.py: pytest ends a
    package-scoped fixture with the package that defines it, which for one registered
    here (a root plugin) would be the whole session."""
    # The module's or package's name ("test_epd", "rdma") prefixes the log files.
    prefix = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.path.name.removesuffix(".py"))
    servers = Servers(tiny_model, tmp_path_factory.mktemp("ep-logs"), prefix)
    try:
        yield servers
    finally:
        servers.stop(show_logs=request.session.testsfailed > 0)


@pytest.fixture(scope="module")
def ep_servers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[EpFactory]:
    """Module-scoped factory: ``ep_servers(name, role=None | "ec_producer" | ..., extra=...)``:
    real-engine connector tests share servers per module (each start costs ~40 s of CPU
    here); every server it started is stopped, by PID, when the module ends."""
    with servers_for(request, tiny_model, tmp_path_factory) as servers:
        yield servers


class CopiesInFlight:
    """Stands in for a writer's ``_to_host`` as on CUDA: each output is staged in a lease
    of the writer's pool and handed back before its bytes landed, with an event whose
    ``synchronize`` waits for ``landed`` (the test sets it), then lands the copy and
    records which thread waited (the writer's, never the step's)."""

    def __init__(self, staging: Any) -> None:
        self.staging = staging
        self.landed = threading.Event()
        self.waited_on: list[str] = []

    def __call__(self, tensor: Any) -> tuple[Any, Any, Any] | None:
        lease = self.staging.take(tensor.numel() * tensor.element_size(), pinned=False)
        if lease is None:
            return None
        host = lease.view(tensor.dtype, tuple(tensor.shape))
        host.fill_(0)  # what the bytes hold before the copy
        return host, _CopyInFlight(self, host, tensor.clone()), lease


class _CopyInFlight:
    def __init__(self, copies: CopiesInFlight, host: Any, src: Any) -> None:
        self.copies, self.host, self.src = copies, host, src

    def synchronize(self) -> None:
        self.copies.waited_on.append(threading.current_thread().name)
        assert self.copies.landed.wait(10)
        self.host.copy_(self.src)  # the copy lands only now

    def query(self) -> bool:
        return self.copies.landed.is_set()
