"""The router package's shared real servers. Defined here, not in the root plugin
(tests/router/fixtures.py), so that they end with the package: pytest ends a
package-scoped fixture with the package that defines it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.router.fixtures import RouterPool, router_pool


@pytest.fixture(scope="package")
def router_servers(
    tiny_model: Path, vllm_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterPool]:
    """One consumer and two producers for ``test_vllm`` and ``test_vllm_groups``. A test
    that stops one is marked ``breaks_shared_servers``: it runs after the package's
    other tests."""
    with router_pool(tiny_model, vllm_logs, tmp_path_factory.mktemp("router-pool")) as pool:
        yield pool
