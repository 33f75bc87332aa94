"""What this package's modules share: the pool's key and the handle of its shared pool
(``sv_servers``, in conftest.py) for the real-engine modules; entries published and
pinned as the scheduler side hands them to a worker, for the unit modules (and
tests/connector/test_loadbuffers.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from e2e.vllm_server import VllmServer
from encoderpool_connector.shared_volume.entry import Header, entry_name, read_prefix
from encoderpool_connector.shared_volume.metadata import LoadSpec
from encoderpool_connector.shared_volume.store import Pins, SharedStore
from encoderpool_contracts.integrity import ChannelKey, checksum

CHANNEL_KEY = "test-shared-volume-pool-key-0123456789"
KEY = ChannelKey(CHANNEL_KEY.encode())  # what a key holder signs with, in forgeries


@dataclass
class SvServers:
    producer: VllmServer
    consumer: VllmServer
    root: Path
    fingerprint: str


FP = "0123456789abcdef"  # the model fingerprint of unit tests' entries


def put(store: SharedStore, mm_hash: str, tokens: int, width: int) -> torch.Tensor:
    """Publish a random bfloat16 entry of ``tokens`` x ``width`` for ``mm_hash``."""
    t = torch.randn(tokens, width).to(torch.bfloat16)
    payload = memoryview(t.view(torch.uint8).numpy()).cast("B")
    header = Header(mm_hash, FP, "bfloat16", (tokens, width), checksum(payload))
    assert store.publish(entry_name(FP, mm_hash), header, payload).published
    return t


def spec_for(pins: Pins, mm_hash: str, shape: tuple[int, int]) -> LoadSpec:
    """What the scheduler hands the worker: a pin of the entry and its inode (the tests
    that corrupt an entry do so after this point, as a hostile writer would)."""
    pin = pins.pin(entry_name(FP, mm_hash))
    assert pin is not None
    fd = os.open(os.path.join(pins.dir, pin), os.O_RDONLY)
    try:
        st = os.fstat(fd)
        offset = read_prefix(fd)[1]
    finally:
        os.close(fd)
    return LoadSpec(
        mm_hash, pins.subdir, pin, True, "bfloat16", shape, (st.st_dev, st.st_ino), offset
    )
