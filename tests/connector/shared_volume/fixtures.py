"""The shared-volume pool that this package's real-engine modules share (registered in
conftest.pytest_plugins): a producer and a consumer with one storage root and the
pool's key, started once for the package (``test_epd``, ``test_video``).

They take request-level media kwargs (``--trust-request-mm-kwargs``): the video tests
send ``media_io_kwargs``; requests without them are served exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.vllm_server import VllmServer
from encoderpool_connector.contracts import CHANNEL_KEY_ENV
from encoderpool_connector.rdma.auth import ChannelKey
from tests.connector.fixtures import EpFactory, sv_config, tiny_fingerprint

CHANNEL_KEY = "test-shared-volume-pool-key-0123456789"
KEY = ChannelKey(CHANNEL_KEY.encode())  # what a key holder signs with, in forgeries


@dataclass
class SvServers:
    producer: VllmServer
    consumer: VllmServer
    root: Path
    fingerprint: str


@pytest.fixture(scope="package")
def sv_servers(
    package_servers: EpFactory, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> SvServers:
    root = tmp_path_factory.mktemp("sv-pool") / "volume" / "ec"
    fingerprint = tiny_fingerprint(tiny_model)
    extra = sv_config(root, fingerprint)
    keyed = {CHANNEL_KEY_ENV: CHANNEL_KEY}
    trust = ["--trust-request-mm-kwargs"]
    producer = package_servers("producer", role="ec_producer", extra=extra, env=keyed, args=trust)
    consumer = package_servers("consumer", role="ec_consumer", extra=extra, env=keyed, args=trust)
    for s in (producer, consumer):
        s.wait_ready(300)
    return SvServers(producer, consumer, root, fingerprint)
