"""The shared-volume package's shared pool. It is defined here, not in a root plugin, so
that it ends with the package: pytest ends a package-scoped fixture with the package
that defines it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from encoderpool_contracts import CHANNEL_KEY_ENV
from tests.connector.fixtures import servers_for, sv_config, tiny_fingerprint
from tests.connector.shared_volume.fixtures import CHANNEL_KEY, SvServers


@pytest.fixture(scope="package")
def sv_servers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[SvServers]:
    """A producer and a consumer with one storage root and the pool's key, started once
    for the package (``test_epd``, ``test_video``). They take request-level media kwargs
    (``--trust-request-mm-kwargs``): the video tests send ``media_io_kwargs``; requests
    without them are served exactly as before."""
    root = tmp_path_factory.mktemp("sv-pool") / "volume" / "ec"
    fingerprint = tiny_fingerprint(tiny_model)
    extra = sv_config(root, fingerprint)
    keyed = {CHANNEL_KEY_ENV: CHANNEL_KEY}
    trust = ["--trust-request-mm-kwargs"]
    with servers_for(request, tiny_model, tmp_path_factory) as servers:
        producer = servers("producer", role="ec_producer", extra=extra, env=keyed, args=trust)
        consumer = servers("consumer", role="ec_consumer", extra=extra, env=keyed, args=trust)
        for s in (producer, consumer):
            s.wait_ready(300)
        yield SvServers(producer, consumer, root, fingerprint)
