"""The rdma package's shared pool. It is defined here, not in a root plugin, so that it
ends with the package: pytest ends a package-scoped fixture with the package that
defines it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.vllm_server import VllmServer, free_port
from tests.connector.fixtures import servers_for, tiny_fingerprint
from tests.connector.rdma.fixtures import CONNECTOR, MODULE, UCX_ENV, RdmaPool, rdma_config
from tests.router.fixtures import RouterProcess


@pytest.fixture(scope="package")
def rdma_pool(
    monolithic: VllmServer,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[RdmaPool]:
    """An EncoderPoolNixlConnector producer and consumer (UCX over tcp/self/sm, the
    producer's side channel on a free 127.0.0.1 port) and the real router in front,
    shared by the package's modules (``test_epd``, ``test_video``), with the session's
    monolithic server to compare with. A test that stops one of them is marked
    ``breaks_shared_servers``: it runs after the package's other tests."""
    fingerprint = tiny_fingerprint(tiny_model)
    port = free_port()
    extra = rdma_config(fingerprint, port)
    kw: dict[str, Any] = {"connector": CONNECTOR, "module": MODULE, "env": UCX_ENV}
    with servers_for(request, tiny_model, tmp_path_factory) as servers:
        producer = servers("producer", role="ec_producer", extra=extra, **kw)
        consumer = servers("consumer", role="ec_consumer", extra=extra, **kw)
        for s in (producer, consumer):
            s.wait_ready(300)
        router = RouterProcess(
            ["--producers", producer.url, "--consumers", consumer.url, "--log-level", "DEBUG"],
            tmp_path_factory.mktemp("rdma-router") / "router.log",
        ).start()
        try:
            yield RdmaPool(monolithic, producer, consumer, router, fingerprint, port)
        finally:
            router.stop()
