"""An rdma pool on kind: NIXL over UCX (TCP and shared memory) between real pods.

The shared-volume example switched to the rdma transport: producers keep each
embedding in registered memory and announce it through the router; the consumer
pod pulls it with a NIXL READ over TCP from the producer pod. Answers equal a
monolithic vLLM pod's, and the consumer never runs its encoder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.kind.cluster import Images, KindCluster, host_sysctls
from e2e.kind.pool import (
    encoded,
    sample_pool,
    status,
    token_ids_pool_and_monolithic,
    wait_ready,
)
from e2e.media import chat_request, image

pytestmark = pytest.mark.kind

NS = "kind-rdma"
POOL = "tiny-rdma"


@pytest.fixture(scope="module")
def pool(
    kind: KindCluster, operator: str, images: Images, tiny_model_dir: Path
) -> Iterator[dict[str, Any]]:
    spec = sample_pool(kind, NS, POOL, tiny_model_dir, images.vllm, transport="rdma")
    kind.apply(spec)
    yield spec
    kind.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def test_rdma_pool_becomes_ready(kind: KindCluster, pool: dict[str, Any]) -> None:
    wait_ready(kind, NS, POOL)
    assert status(kind, NS, POOL)["transport"] == "rdma"


def test_rdma_answer_equals_monolithic_and_consumer_did_not_encode(
    kind: KindCluster, pool: dict[str, Any]
) -> None:
    bodies = [chat_request(image(10 + i), max_tokens=8) for i in range(3)]
    got, expected = token_ids_pool_and_monolithic(kind, NS, pool, bodies)
    assert got == expected
    assert encoded(kind, NS, POOL, "producer") >= len(bodies), "the producer never ran its encoder"
    assert encoded(kind, NS, POOL, "consumer") == 0, "the consumer encoded by itself"


def test_rdma_host_sysctls_unchanged(sysctls_before: dict[str, str], pool: dict[str, Any]) -> None:
    assert host_sysctls() == sysctls_before
