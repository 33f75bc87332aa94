"""What this package's real-engine modules share: the pool's key and the handle of its
shared pool (``sv_servers``, in conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from e2e.vllm_server import VllmServer
from encoderpool_contracts.integrity import ChannelKey

CHANNEL_KEY = "test-shared-volume-pool-key-0123456789"
KEY = ChannelKey(CHANNEL_KEY.encode())  # what a key holder signs with, in forgeries


@dataclass
class SvServers:
    producer: VllmServer
    consumer: VllmServer
    root: Path
    fingerprint: str
