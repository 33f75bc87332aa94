"""The rdma consumer worker's loads onto a CUDA device: staged in a pinned buffer of the
load pool (``core.loadbuffers``) and uploaded on a side stream (``core.streams``), the
buffer held until the upload ran. Stand-ins for the pinned allocation and the uploads
(no GPU here); the copy paths themselves are tested in shared_volume/test_staging.py."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from encoderpool_connector.core import loadbuffers
from encoderpool_connector.rdma import worker as worker_module
from encoderpool_connector.rdma.buffer import SharedRegion
from encoderpool_connector.rdma.metadata import LoadPlan, RdmaMetadata
from encoderpool_connector.rdma.worker import RdmaWorker
from encoderpool_contracts import ConnectorConfig

SHAPE = (4096, 128)  # bfloat16: 1 MiB, the smallest load the pool serves
NBYTES = SHAPE[0] * SHAPE[1] * 2


class Uploads:
    """Records what ``DeviceUploads.start`` is handed; returns a copy as the device's."""

    made: list[Uploads] = []

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.hosts: list[torch.Tensor] = []
        Uploads.made.append(self)

    def start(self, host: torch.Tensor) -> torch.Tensor:
        self.hosts.append(host)
        return host.clone()


@pytest.fixture
def region() -> Iterator[SharedRegion]:
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ep-rdma-loads-") as d:
        r = SharedRegion.create(d, 4 << 20)
        yield r
        r.close()


def consumer(shm_dir: str, device: str) -> RdmaWorker:
    cfg = ConnectorConfig(
        transport="rdma",
        model_fingerprint="0123456789abcdef",
        encoder_output_widths={"image": SHAPE[1]},
        rdma={"shm_dir": shm_dir, "buffer_bytes": 4 << 20},
    )
    w = RdmaWorker(cfg, is_producer=False, is_consumer=True)
    w._device = torch.device(device)
    return w


def test_a_load_onto_cuda_is_staged_in_a_pinned_buffer_and_uploaded_on_the_side_stream(
    region: SharedRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    pinned: list[bool] = []
    real_allocate = loadbuffers._allocate

    def allocate(capacity: int, pin: bool) -> torch.Tensor:
        pinned.append(pin)
        return real_allocate(capacity, False)  # no CUDA here to pin with

    monkeypatch.setattr(loadbuffers, "_allocate", allocate)
    Uploads.made = []
    monkeypatch.setattr(worker_module, "DeviceUploads", Uploads)
    want = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    region.view[0:NBYTES] = want.view(torch.uint8).numpy().tobytes()
    w = consumer(region.path.rsplit("/", 1)[0], "cuda:0")
    try:
        meta = RdmaMetadata(
            region=region.path,
            region_bytes=region.size,
            loads=[LoadPlan("x", 0, "bfloat16", SHAPE, "c1", 0)],
        )
        cache: dict[str, Any] = {}
        w.start_load_caches(cache, meta)
        assert torch.equal(cache["x"], want)
        assert pinned == [True]  # one pinned slot of the pool
        (uploads,) = Uploads.made
        assert uploads.device == torch.device("cuda:0")
        (host,) = uploads.hosts
        assert w._buffers is not None
        assert w._buffers.pinned
        assert w._buffers.free_slots == 0  # lent while the upload holds the host tensor
        assert torch.equal(host, want)
        del host
        uploads.hosts.clear()  # the upload's event reported done
        assert w._buffers.free_slots == 1
        report = w.build_connector_worker_meta()
        assert report is not None
        assert report.loaded == {"x"}
        assert "load_buffer_fallbacks" not in report.stats
    finally:
        w.shutdown()


def test_a_load_onto_the_cpu_is_a_copy_of_its_own(region: SharedRegion) -> None:
    """On CPU the tensor vLLM keeps owns its bytes: the region's slot is reused once the
    scheduler hears the load finished."""
    want = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    region.view[0:NBYTES] = want.view(torch.uint8).numpy().tobytes()
    w = consumer(region.path.rsplit("/", 1)[0], "cpu")
    try:
        meta = RdmaMetadata(
            region=region.path,
            region_bytes=region.size,
            loads=[LoadPlan("x", 0, "bfloat16", SHAPE, "c1", 0)],
        )
        cache: dict[str, Any] = {}
        w.start_load_caches(cache, meta)
        region.view[0:NBYTES] = bytes(NBYTES)  # the slot reused
        assert torch.equal(cache["x"], want)
        assert w._buffers is None
    finally:
        w.shutdown()
