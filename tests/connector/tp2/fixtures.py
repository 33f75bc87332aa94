"""The TP=2 monolithic reference that both transports' tp2 modules compare with
(registered in conftest.pytest_plugins): one start for the package, not one per module.
A TP=2 server is an API server, an engine core and two worker ranks bound to cores 0
and 1; idle, it costs ~4 % of a core."""

from __future__ import annotations

import pytest

from e2e.vllm_server import VllmServer, tensor_parallel
from tests.connector.fixtures import EpFactory


@pytest.fixture(scope="package")
def mono_tp2(package_servers: EpFactory) -> VllmServer:
    args, env = tensor_parallel(2)
    return package_servers("mono", env=env, args=args).wait_ready(300)
