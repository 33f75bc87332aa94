"""What the rdma connector's real-engine tests share: configs and the pool's handle
(``RdmaPool``; the package's pool itself is ``rdma_pool`` in conftest.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from e2e.media import chat_request, encoder_request, image_part, token_ids
from e2e.vllm_server import VllmServer
from encoderpool_contracts import CHANNEL_KEY_ENV, ConnectorConfig
from tests.connector.fixtures import TINY_WIDTHS
from tests.router.fixtures import RouterProcess, encoded_hashes

CONNECTOR = "EncoderPoolNixlConnector"
MODULE = "encoderpool_connector.rdma"
CHANNEL_KEY = "epd-test-channel-key-0123456789abcdef"  # as the pool's Secret gives it
UCX_ENV = {
    "UCX_TLS": "tcp,self,sm",
    "ENCODERPOOL_ADVERTISE_HOST": "127.0.0.1",
    CHANNEL_KEY_ENV: CHANNEL_KEY,
}


def rdma_config(fingerprint: str, port: int, **settings: Any) -> dict[str, Any]:
    """A valid rdma ``ec_connector_extra_config``, as the operator renders it."""
    rdma: dict[str, Any] = {
        "side_channel_port": port,
        "buffer_bytes": 64 << 20,
        "bind_host": "127.0.0.1",
        "transfer_timeout_ms": 3000,
        "metadata_timeout_ms": 1000,
        **settings,
    }
    cfg = ConnectorConfig(
        transport="rdma",
        model_fingerprint=fingerprint,
        encoder_output_widths=TINY_WIDTHS,
        rdma=rdma,
    )
    return cfg.to_extra_config()


@dataclass
class RdmaPool:
    mono: VllmServer
    producer: VllmServer
    consumer: VllmServer
    router: RouterProcess
    fingerprint: str
    side_channel_port: int

    def encode(self, png: bytes) -> tuple[str, dict[str, Any]]:
        """What the router does per item; returns (mm_hash, the producer's params)."""
        out = self.producer.chat(encoder_request(image_part(png)))
        assert out["usage"]["completion_tokens"] == 0, out
        params = out["ec_transfer_params"]
        ((mm_hash, item),) = params.items()
        assert item["metadata"]["image_grid_thw"], item
        return mm_hash, params

    def consume(self, png: bytes, params: dict[str, Any] | None) -> list[int]:
        body = chat_request(png)
        if params is not None:
            body["ec_transfer_params"] = params
        return token_ids(self.consumer.chat(body))

    def expected(self, png: bytes) -> list[int]:
        return token_ids(self.mono.chat(chat_request(png)))

    def consumer_encoded(self) -> set[str]:
        return encoded_hashes(self.consumer.log_text())

    def producer_encoded(self) -> set[str]:
        return encoded_hashes(self.producer.log_text())
