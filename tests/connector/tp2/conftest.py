"""The TP=2 monolithic reference that both transports' tp2 modules compare with: one
start for the package, not one per module. Defined here, not in a root plugin, so that
it ends with the package (pytest ends a package-scoped fixture with the package that
defines it). A TP=2 server is an API server, an engine core and two worker ranks bound
to cores 0 and 1; idle, it costs ~4 % of a core."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.vllm_server import VllmServer, tensor_parallel
from tests.connector.fixtures import servers_for


@pytest.fixture(scope="package")
def mono_tp2(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[VllmServer]:
    args, env = tensor_parallel(2)
    with servers_for(request, tiny_model, tmp_path_factory) as servers:
        yield servers("mono", env=env, args=args).wait_ready(300)
