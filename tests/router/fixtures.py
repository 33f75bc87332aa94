"""Fixtures for the router tests (registered in conftest.pytest_plugins).

In-process fake producers/consumers (aiohttp apps on 127.0.0.1) for the many
unit tests; EndpointSlices and a resolver for the tests on the local control
plane; real vLLM servers plus the router as a process for the few end-to-end
ones. Which EC connector the real servers use is one
entry in ``CONNECTORS``, chosen by ``EC_CONNECTOR``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult

from e2e.media import data_url, image
from e2e.vllm_server import (
    REPO,
    VllmServer,
    base_env,
    ec_transfer_config,
    free_port,
    stop_all,
)
from encoderpool_contracts import API_GUARD_MIDDLEWARE as API_GUARD
from encoderpool_contracts.pod import CACHE_DIR_ENV, VOLUME_METRICS_MIDDLEWARE
from encoderpool_contracts.router_args import PROBE_PORT_ENV
from encoderpool_router.app import Router, build_app
from encoderpool_router.config import RouterSettings
from tests.connector.fixtures import LOGGING_CONFIG

T = TypeVar("T")

# --- running async scenarios from plain tests ------------------------------------------


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    """Run one async scenario with a bound, so a hang fails the test instead of the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def serve(app: web.Application, cancel_on_disconnect: bool = True) -> AsyncIterator[str]:
    """Serve ``app`` on a free 127.0.0.1 port; yields its base URL."""
    runner = web.AppRunner(app, handler_cancellation=cancel_on_disconnect, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def router_at(
    producers: list[str] | None = None,
    consumers: list[str] | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[Router, str]]:
    """An in-process router over static backends; yields it and its base URL."""
    s = RouterSettings(
        producers=tuple(producers or ()), consumers=tuple(consumers or ()), **settings
    )
    router = Router(s)
    async with serve(build_app(router)) as url:
        yield router, url


# --- fake backends ------------------------------------------------------------------------


def fake_mm_hash(part: dict[str, Any]) -> str:
    """What the fake producer reports as an item's hash: a function of the part only."""
    return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None
    raw: bytes = b""  # the body's bytes as they arrived


@dataclass
class FakeBackend:
    """A producer or consumer speaking just enough OpenAI for the router.

    ``mode``: ok | error (500) | unavailable (503) | bad_request (400) | unauthorized
    (401: the pool's key refused) | hang
    (never answers) | no_params (a producer answering without ec_transfer_params)
    | stream_break (a consumer stream that stops mid-way).
    """

    name: str
    mode: str = "ok"
    delay_s: float = 0.0
    seen: list[Seen] = field(default_factory=list)
    cancelled: int = 0
    # A consumer stream waits on this after its first chunk, so a test can prove
    # the first chunk reached the client before the rest exists.
    gate: asyncio.Event | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        # The other APIs a consumer serves answer as chat does: the tests look at what
        # the router sent and relayed, not at the answer's shape.
        for path in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
            app.router.add_post(path, self._chat)
        app.router.add_post("/tokenize", self._chat)
        app.router.add_post("/detokenize", self._chat)
        app.router.add_get("/version", self._models)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        self.seen.append(
            Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, None)
        )
        return web.json_response({"object": "list", "data": [{"id": self.name}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.seen.append(
            Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, body, raw)
        )
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.mode == "hang":
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        statuses = {"error": 500, "unavailable": 503, "bad_request": 400, "unauthorized": 401}
        if self.mode in statuses:
            status = statuses[self.mode]
            return web.json_response({"error": {"message": self.mode}}, status=status)
        if self.name.startswith("producer"):
            return self._encoded(body)
        if body.get("stream"):
            return await self._stream(request, body)
        return web.json_response(
            {
                "served_by": self.name,
                "ec_transfer_params_seen": body.get("ec_transfer_params"),
                "choices": [{"index": 0, "message": {"content": "ok"}, "token_ids": [1, 2, 3]}],
            }
        )

    def _encoded(self, body: dict[str, Any]) -> web.Response:
        (part,) = body["messages"][0]["content"]
        params = {} if self.mode == "no_params" else {fake_mm_hash(part): {"by": self.name}}
        return web.json_response(
            {"usage": {"completion_tokens": 0}, "ec_transfer_params": params or None}
        )

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            for i in range(4):
                chunk = {"served_by": self.name, "choices": [{"token_ids": [i]}]}
                await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if i == 0 and self.gate is not None:
                    await self.gate.wait()
                if i == 1 and self.mode == "stream_break":
                    assert request.transport is not None
                    request.transport.close()
                    return out
            await out.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return out


@contextlib.asynccontextmanager
async def fakes(*backends: FakeBackend) -> AsyncIterator[list[str]]:
    """Serve each fake backend; yields their base URLs in order."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serve(b.app())) for b in backends]


def video_part(index: int) -> dict[str, Any]:
    """A video item as the chat API takes it (the fakes never decode it)."""
    return {"type": "video_url", "video_url": {"url": data_url(image(index))}}


def sent_parts(backend: FakeBackend) -> list[dict[str, Any]]:
    """The media parts a fake producer was sent, in order."""
    return [part for s in backend.seen if s.body for part in s.body["messages"][0]["content"]]


# --- EndpointSlices on the local control plane ----------------------------------------
# The API server refuses loopback addresses in EndpointSlices, and kwok pod IPs are fake
# and must never be contacted: slices carry names of a test-only domain, which the
# router's injected resolver maps to 127.0.0.1.

DOMAIN = "encoderpool-router.test"


class LoopbackResolver(AbstractResolver):
    """``*.encoderpool-router.test`` is 127.0.0.1; every other name is an error."""

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if not host.endswith("." + DOMAIN):
            raise OSError(f"the test resolver refuses {host!r}")
        return [
            ResolveResult(hostname=host, host="127.0.0.1", port=port, family=socket.AF_INET,
                          proto=0, flags=socket.AI_NUMERICHOST)
        ]  # fmt: skip

    async def close(self) -> None:
        return None


def service(name: str) -> dict[str, Any]:
    """A Service without a selector: its EndpointSlices are ours to write."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"ports": [{"name": "http", "port": 8000}]},
    }


def uid_of(kubectl: Callable[..., str], kind: str, name: str) -> str:
    return kubectl("get", kind, name, "-o", "jsonpath={.metadata.uid}").strip()


def endpoint_slice(
    svc: str, host: str, url: str, ready: bool, service_uid: str | None
) -> dict[str, Any]:
    """One backend: its port is the fake's loopback port, its address a test-domain name.

    With ``service_uid``, as the EndpointSlice controller makes them for that Service
    (the router uses no other); without, a forgery that only carries the labels."""
    owners = [] if service_uid is None else [
        {"apiVersion": "v1", "kind": "Service", "name": svc, "uid": service_uid,
         "controller": True, "blockOwnerDeletion": True}
    ]  # fmt: skip
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{svc}-{host}",
            "labels": {
                "kubernetes.io/service-name": svc,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
            "ownerReferences": owners,
        },
        "addressType": "FQDN",
        "ports": [{"name": "http", "port": int(url.rsplit(":", 1)[1]), "protocol": "TCP"}],
        "endpoints": [{"addresses": [f"{host}.{DOMAIN}"], "conditions": {"ready": ready}}],
    }


# --- real vLLM servers and the router process ---------------------------------------------

# Which EC connector the real-engine tests use: switching is this one line.
EC_CONNECTOR = "encoderpool"

ConnectorSpec = tuple[str, dict[str, Any], str | None]


def _example(store: Path, model: Path) -> ConnectorSpec:
    """vLLM's built-in ECExampleConnector (a file per item, no params needed)."""
    return "ECExampleConnector", {"shared_storage_path": str(store)}, None


def _encoderpool(store: Path, model: Path) -> ConnectorSpec:
    """Our shared-volume connector, configured as the operator renders it."""
    from tests.connector.fixtures import CONNECTOR, MODULE, sv_config, tiny_fingerprint

    return CONNECTOR, sv_config(store, tiny_fingerprint(model)), MODULE


CONNECTORS: dict[str, Callable[[Path, Path], ConnectorSpec]] = {
    "example": _example,
    "encoderpool": _encoderpool,
}

ENCODED_LINE = "Finish execute for mm hash"


def encoded_hashes(log: str) -> set[str]:
    """mm hashes whose encoder ran in the process that wrote ``log``."""
    return {
        line.split(ENCODED_LINE, 1)[1].split()[0].strip(" :,.")
        for line in log.splitlines()
        if ENCODED_LINE in line
    }


@dataclass
class RouterProcess:
    """``python -m encoderpool_router`` on 127.0.0.1, stopped by PID."""

    args: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    probe_port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)  # e.g. the backend key
    cpus: str | None = None  # pin with taskset (benchmarks), e.g. "0"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> RouterProcess:
        """Start it; ports another process took between ``free_port`` and the bind are
        replaced by fresh ones (up to three tries: a race with other suites' sockets)."""
        for attempt in range(3):
            try:
                return self._start(timeout)
            except RuntimeError as e:
                if "address already in use" not in str(e) or attempt == 2:
                    raise
                self.port, self.metrics_port, self.probe_port = (free_port() for _ in range(3))
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> RouterProcess:
        env = {**base_env(), PROBE_PORT_ENV: str(self.probe_port), **self.env}
        pin = ["taskset", "-c", self.cpus] if self.cpus is not None else []
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    *pin,
                    sys.executable,
                    "-m",
                    "encoderpool_router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--metrics-port",
                    str(self.metrics_port),
                    *self.args,
                ],
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited {self.proc.returncode}: {self.log_text()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    return self
            time.sleep(0.1)
        raise TimeoutError(f"router not healthy after {timeout}s: {self.log_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def metric(self, name: str, **labels: str) -> float:
        """One sample from the router's /metrics (0 when absent)."""
        metrics = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(metrics, timeout=10) as r:
            text = r.read().decode()
        want = name + (
            "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""
        )
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0


# The pool's key toward its vLLM pods, as the operator gives it (VLLM_API_KEY from the
# pool's internal Secret, plus our guard for the routes vLLM's own check leaves open).
API_KEY = "test-pool-key-" + "k" * 32


def keyed(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """vLLM args and env of a producer or consumer that answers only with ``API_KEY``."""
    return ["--middleware", API_GUARD], {**env, "VLLM_API_KEY": API_KEY}


@dataclass
class RouterPool:
    """The package's real servers: one consumer and two producers with ``EC_CONNECTOR``
    on one store, all holding ``API_KEY``. ``test_vllm`` routes to ``producer``;
    ``test_vllm_groups`` makes ``producer`` the image group and ``video`` the video group.
    """

    consumer: VllmServer
    producer: VllmServer
    video: VllmServer
    store: Path


@contextlib.contextmanager
def router_pool(tiny_model: Path, logs: Path, work: Path) -> Iterator[RouterPool]:
    """Start a ``RouterPool`` (a start costs ~40 s of CPU here, so the package shares
    one: tests/router/conftest.py); every server is stopped, by PID, at the end."""
    logging_config = work / "logging.json"
    logging_config.write_text(json.dumps(LOGGING_CONFIG))
    store = work / "ec"
    store.mkdir()
    name, extra, module = CONNECTORS[EC_CONNECTOR](store, tiny_model)

    def server(role: str, cpu: str, ec_role: str) -> VllmServer:
        env = {**base_env(cpu), "VLLM_LOGGING_CONFIG_PATH": str(logging_config)}
        guard, env = keyed(env)
        # As the operator renders a shared-volume pod: the volume's gauges on /metrics.
        guard += ["--middleware", VOLUME_METRICS_MIDDLEWARE]
        env[CACHE_DIR_ENV] = str(store)
        args = ["--ec-transfer-config", ec_transfer_config(name, ec_role, extra, module), *guard]
        log = logs / f"router-{os.getpid()}-{role}.log"
        return VllmServer(name=role, model=tiny_model, log_path=log, args=args, env=env)

    servers = [
        server("consumer", "0", "ec_consumer"),
        server("producer", "1", "ec_producer"),
        server("video", "1", "ec_producer"),
    ]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(300)
        consumer, producer, video = servers
        yield RouterPool(consumer, producer, video, store)
    finally:
        stop_all(servers)


@dataclass
class Epd:
    """A monolithic reference server, one producer, one consumer and a router in front.

    Producer and consumer hold ``API_KEY`` (the router sends it); the monolithic
    server, the tests' reference, holds none.
    """

    mono: VllmServer
    producer: VllmServer
    consumer: VllmServer
    router: RouterProcess
    store: Path


@pytest.fixture(scope="module")
def epd(router_servers: RouterPool, vllm_logs: Path, monolithic: VllmServer) -> Iterator[Epd]:
    """A router over the package's producer and consumer, and the session's monolithic
    server."""
    router = RouterProcess(
        ["--producers", router_servers.producer.url,
         "--consumers", router_servers.consumer.url,
         "--log-level", "DEBUG"],
        vllm_logs / f"router-{os.getpid()}-router.log",
        env={"ENCODERPOOL_ROUTER_BACKEND_API_KEY": API_KEY},
    ).start()  # fmt: skip
    pool = router_servers
    try:
        yield Epd(monolithic, pool.producer, pool.consumer, router, pool.store)
    finally:
        router.stop()
