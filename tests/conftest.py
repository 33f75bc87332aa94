"""Shared fixtures: the tiny model, real vLLM servers, the local control plane."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.tiny_model import ensure_tiny_model
from e2e.vllm_server import VllmServer, base_env, ec_transfer_config

# Fixtures by area, one module each, so that parallel work does not collide here.
pytest_plugins = [
    "tests.cluster.fixtures",
    "tests.operator.fixtures",
    "tests.connector.fixtures",
    "tests.router.fixtures",
]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The deterministic tiny Qwen2-VL, built once and cached outside the repo."""
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def vllm_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def monolithic(
    tiny_model: Path, vllm_logs: Path, request: pytest.FixtureRequest
) -> Iterator[VllmServer]:
    """The monolithic reference every real-engine pool test compares with: vLLM without a
    connector, TP=1, the test bed's defaults. One for the session, started by the first
    test that needs it: a start costs ~40 s of CPU here, an idle server ~2 % of a core.
    Its answers do not depend on what it served before (``test_vllm_smoke`` checks),
    so tests may share it. It takes request-level media kwargs
    (``--trust-request-mm-kwargs``), which the video tests send."""
    server = VllmServer(
        name="monolithic",
        model=tiny_model,
        log_path=vllm_logs / "monolithic.log",
        args=["--trust-request-mm-kwargs"],
        env=base_env("0"),
    )
    try:
        yield server.start().wait_ready(300)
    finally:
        server.stop()
        if request.session.testsfailed:
            print(f"\n===== log of vLLM server monolithic ({server.log_path}) =====")
            print(server.log_tail(60))


ServerFactory = Callable[..., VllmServer]


@pytest.fixture
def vllm_server(
    tiny_model: Path, vllm_logs: Path, request: pytest.FixtureRequest
) -> Iterator[ServerFactory]:
    """Factory for real vLLM servers, stopped (by PID) when the test ends.

    ``vllm_server("mono")`` is a monolithic server; give ``ec`` (connector
    name, role, extra config, optional module) for a producer or consumer.
    Servers are started, not awaited: call ``.wait_ready()`` (or use
    ``e2e.vllm_server.running``) so several can load at once. On failure the
    tail of each log is printed.
    """
    started: list[VllmServer] = []
    test = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:80]

    def make(
        name: str,
        *,
        ec: tuple[str, str, dict[str, Any]] | tuple[str, str, dict[str, Any], str] | None = None,
        cpu: str | None = None,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        start: bool = True,
    ) -> VllmServer:
        argv = list(args or [])
        if ec is not None:
            argv += ["--ec-transfer-config", ec_transfer_config(*ec)]
        cpu = cpu if cpu is not None else str(len(started) % 2)
        server = VllmServer(
            name=name,
            model=tiny_model,
            log_path=vllm_logs / f"{test}-{name}.log",
            args=argv,
            env={**base_env(cpu), **(env or {})},
        )
        started.append(server)
        return server.start() if start else server

    yield make
    failed = getattr(request.node, "rep_call", None)
    for server in started:
        server.stop()
        if failed is not None and failed.failed:
            print(f"\n===== log of vLLM server {server.name} ({server.log_path}) =====")
            print(server.log_tail(120))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``breaks_shared_servers`` stop servers that several modules of their
    package share (a package-scoped fixture): they run after every other test of the package
    (its directory; a package's tests are collected together)."""
    last = {item.path.parent: i for i, item in enumerate(items)}
    held: dict[Path, list[pytest.Item]] = {}
    ordered: list[pytest.Item] = []
    for i, item in enumerate(items):
        folder = item.path.parent
        if item.get_closest_marker("breaks_shared_servers"):
            held.setdefault(folder, []).append(item)
        else:
            ordered.append(item)
        if last[folder] == i:
            ordered += held.pop(folder, [])
    items[:] = ordered


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the item so fixtures can tell a failed test."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)
