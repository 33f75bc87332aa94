"""RDMA transport (NIXL READ, two processes) vs the shared-volume store load, same items, one run.

    python -m benchmarks.rdma_transfer [--large 20] [--small 100] [--dir /path]

Items: "large" is a real image embedding (1,300 tokens x 3,584 wide, bf16, about
9.3 MB); "small" the tiny model's (64 x 128). A producer process copies each
item into its registered region with the connector's own worker code (memcpy
plus BLAKE3: the producer's step-path cost, reported as ``save``) and serves
its NIXL metadata on the side channel. This process is the consumer, with the
connector's own puller. Per item, both transports are timed from "the
scheduler knows where the item is" to "a verified tensor in this process's
memory":

- nixl: READ into the consumer's registered region + BLAKE3 verify (the
  puller thread, before ``has_cache_item`` says yes) + the worker's copy out
  of the region into a new tensor.
- shared_volume: ``SharedStore.verify`` (read + BLAKE3, before ``has_cache_item``)
  + the worker's read into a new tensor, from the page cache (files just written).

UCX uses what ``UCX_TLS`` allows; this script sets ``tcp,self,sm`` unless it is
set already. Last line: RESULT nixl_gbps=<x> shared_volume_gbps=<y> ratio=<x/y>
(large items, per-item medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.stats import median_ms

FP = "0123456789abcdef"
LARGE = (1300, 3584)
SMALL = (64, 128)


def _key() -> Any:
    """Both sides sign as a pool does (the channel key), so the figures include it."""
    from encoderpool_contracts.integrity import ChannelKey

    return ChannelKey(b"encoderpool-benchmark-channel-key")


def _config(buffer_bytes: int, shm_dir: str) -> Any:
    from encoderpool_contracts import ConnectorConfig

    return ConnectorConfig(
        transport="rdma",
        model_fingerprint=FP,
        rdma={"buffer_bytes": buffer_bytes, "bind_host": "127.0.0.1", "shm_dir": shm_dir},
    )


def _tensors(kind: str, n: int, shape: tuple[int, int]) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0 if kind == "large" else 1)
    return {
        f"{kind}-{i:04d}": torch.randn(shape, generator=gen).to(torch.bfloat16) for i in range(n)
    }


def serve(shm_dir: str, n_large: int, n_small: int) -> None:
    """The producer process: write every item with the worker's code, print coordinates."""
    from encoderpool_connector.rdma.buffer import (
        HEADER_BYTES,
        SharedRegion,
        SlotAllocator,
        unpack_slot_header,
    )
    from encoderpool_connector.rdma.channel import Coordinates, SideChannelServer
    from encoderpool_connector.rdma.metadata import RdmaMetadata, WritePlan
    from encoderpool_connector.rdma.transfer import ProducerAgent
    from encoderpool_connector.rdma.worker import RdmaWorker

    items = {**_tensors("large", n_large, LARGE), **_tensors("small", n_small, SMALL)}
    size = sum(HEADER_BYTES + t.numel() * 2 + 64 for t in items.values())
    cfg = _config(max(size, 1 << 20), shm_dir)
    region = SharedRegion.create(shm_dir, cfg.rdma.buffer_bytes)
    agent = ProducerAgent(region, ("UCX",), key=_key())
    channel = SideChannelServer(
        "127.0.0.1", 0, agent.side_channel_reply(FP), timeout=5.0, key=_key()
    )
    alloc = SlotAllocator(region.size)
    worker = RdmaWorker(cfg, is_producer=True, is_consumer=False)
    plans = []
    for h, t in items.items():
        slot, _ = alloc.allocate(h, HEADER_BYTES + t.numel() * 2)
        assert slot is not None
        plans.append(WritePlan(h, slot.offset, slot.size - HEADER_BYTES, slot.generation))
    meta = RdmaMetadata(region=region.path, region_bytes=region.size, writes=plans)
    worker.start_save_caches({}, meta)
    out = []
    for plan in plans:
        t0 = time.perf_counter()
        worker.save_caches(items, plan.mm_hash)
        save_s = time.perf_counter() - t0
        header = unpack_slot_header(region.view[plan.offset : plan.offset + HEADER_BYTES])
        assert header is not None
        c = Coordinates(
            agent.name,
            "127.0.0.1",
            channel.port,
            plan.offset + HEADER_BYTES,
            header.payload_bytes,
            header.dtype,
            header.shape,
            "blake3:" + header.checksum.hex(),
            plan.generation,
        )
        out.append({"mm_hash": plan.mm_hash, "coords": c.to_json(), "save_s": save_s})
    print(json.dumps(out), flush=True)
    sys.stdin.read()  # until the consumer closes our stdin
    worker.shutdown()
    channel.close()
    agent.close()
    region.close()


def bench_nixl(items: list[dict[str, Any]], shm_dir: str) -> dict[str, dict[str, float]]:
    import torch

    from encoderpool_connector.rdma.buffer import SharedRegion
    from encoderpool_connector.rdma.channel import parse_coordinates
    from encoderpool_connector.rdma.metadata import LoadPlan, RdmaMetadata
    from encoderpool_connector.rdma.transfer import Puller
    from encoderpool_connector.rdma.worker import RdmaWorker

    biggest = max(i["coords"]["size"] for i in items)
    cfg = _config(max(2 * biggest + 4096, 1 << 20), shm_dir)
    region = SharedRegion.create(shm_dir, cfg.rdma.buffer_bytes)
    puller = Puller(region, ("UCX",), fingerprint=FP, metadata_timeout=5.0, key=_key())
    worker = RdmaWorker(cfg, is_producer=False, is_consumer=True)
    worker._device = torch.device("cpu")
    res: dict[str, dict[str, list[float]]] = {}
    try:
        # Warm-up: the metadata fetch and UCX connection happen once per producer.
        first = parse_coordinates(items[0]["coords"])
        assert puller.submit(first, 0, 30).result(60).ok
        for it in items:
            kind = it["mm_hash"].split("-")[0]
            c = parse_coordinates(it["coords"])
            r = res.setdefault(kind, {"pull": [], "copy": [], "total": [], "save": []})
            t0 = time.perf_counter()
            result = puller.submit(c, 0, 30).result(60)
            t1 = time.perf_counter()
            assert result.ok, result
            cache: dict[str, torch.Tensor] = {}
            meta = RdmaMetadata(
                region=region.path,
                region_bytes=region.size,
                loads=[LoadPlan(it["mm_hash"], 0, c.dtype, c.shape)],
            )
            worker.start_load_caches(cache, meta)
            t2 = time.perf_counter()
            assert cache[it["mm_hash"]].shape == c.shape
            r["pull"].append(t1 - t0)
            r["copy"].append(t2 - t1)
            r["total"].append(t2 - t0)
            r["save"].append(it["save_s"])
        # Pipelined: every large item in flight at once (distinct local slots).
        large = [parse_coordinates(i["coords"]) for i in items if i["mm_hash"].startswith("large")]
        batch = large[: max(1, (region.size - 4096) // max(1, biggest) - 1)]
        t0 = time.perf_counter()
        futs = [puller.submit(c, k * (biggest + 64) // 64 * 64, 30) for k, c in enumerate(batch)]
        assert all(f.result(120).ok for f in futs)
        pipelined = sum(c.size for c in batch) / (time.perf_counter() - t0) / 1e9
    finally:
        worker.shutdown()
        puller.close()
        region.close()
    out: dict[str, dict[str, float]] = {}
    for kind, r in res.items():
        nbytes = parse_coordinates(
            next(i for i in items if i["mm_hash"].startswith(kind))["coords"]
        ).size
        out[kind] = {
            "producer_save_ms": median_ms(r["save"]),
            "nixl_pull_ms": median_ms(r["pull"]),
            "nixl_copy_out_ms": median_ms(r["copy"]),
            "nixl_total_ms": median_ms(r["total"]),
            "nixl_GBps": nbytes / statistics.median(r["total"]) / 1e9,
        }
    out["large"]["nixl_pipelined_GBps"] = pipelined
    return out


def bench_shared_volume(n: int, kind: str, shape: tuple[int, int], root: Path) -> dict[str, float]:
    import torch

    from encoderpool_connector.core.ranks import Rank
    from encoderpool_connector.shared_volume.entry import Expect, entry_name
    from encoderpool_connector.shared_volume.metadata import LoadSpec
    from encoderpool_connector.shared_volume.store import Pins, SharedStore
    from encoderpool_connector.shared_volume.worker import (
        BackgroundWriter,
        SharedVolumeWorker,
        writer_stats,
    )

    tensors = _tensors(kind, n, shape)
    store = SharedStore(str(root / kind), capacity_bytes=1 << 40, eviction="lru")
    store.prepare_producer()
    writer = BackgroundWriter(store, FP, maxsize=max(64, n), stats=writer_stats())
    for h in tensors:
        writer.submit(h, tensors[h])
    writer.flush()
    writer.close()
    pins = Pins(store)
    worker = SharedVolumeWorker.__new__(SharedVolumeWorker)
    worker.stats, worker._failed, worker._device = writer_stats(), set(), torch.device("cpu")
    worker.store = store
    worker.rank = Rank(0, 1)
    worker._buffers, worker._buffer_limit, worker._fallback_logged = None, 256 << 20, False
    total = []
    for h in tensors:
        pin = pins.pin(entry_name(FP, h))
        assert pin is not None
        t0 = time.perf_counter()
        v = store.verify(pins.subdir, pin, Expect(h, FP, "bfloat16", shape[0], shape[1]))
        tensor = worker._load(
            LoadSpec(h, pins.subdir, pin, True, "bfloat16", shape, v.inode, v.offset)
        )
        total.append(time.perf_counter() - t0)
        pins.drop(pin)  # the scheduler side's part once the step is reported
        assert torch.equal(tensor, tensors[h])
    pins.close()
    nbytes = shape[0] * shape[1] * 2
    return {
        "sv_total_ms": median_ms(total),
        "sv_GBps": nbytes / statistics.median(total) / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--large", type=int, default=20)
    p.add_argument("--small", type=int, default=100)
    p.add_argument("--dir", type=Path, default=None, help="Filesystem for the shared volume.")
    p.add_argument("--shm-dir", default="/dev/shm", help="tmpfs for the registered regions.")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("UCX_TLS", "tcp,self,sm")
    if args.serve:
        serve(args.shm_dir, args.large, args.small)
        return 0
    cmd = [sys.executable, "-m", "benchmarks.rdma_transfer", "--serve", "--shm-dir", args.shm_dir]
    cmd += ["--large", str(args.large), "--small", str(args.small)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = "x"
        while line and not line.startswith("["):  # NIXL logs to stdout too
            line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"producer exited {proc.wait()} before serving")
        items = json.loads(line)
        nixl = bench_nixl(items, args.shm_dir)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(30)
    with tempfile.TemporaryDirectory(prefix="ep-bench-rdma-", dir=args.dir) as d:
        sv = {
            "small": bench_shared_volume(args.small, "small", SMALL, Path(d)),
            "large": bench_shared_volume(args.large, "large", LARGE, Path(d)),
        }
    print(f"UCX_TLS={os.environ['UCX_TLS']} cpus={os.cpu_count()}")
    for kind, shape in (("small", SMALL), ("large", LARGE)):
        print(f"{kind}: {shape[0]}x{shape[1]} bf16 ({shape[0] * shape[1] * 2 / 1e6:.2f} MB)")
        for k, v in {**nixl[kind], **sv[kind]}.items():
            print(f"  {k:22s} {v:10.4f}")
    x, y = nixl["large"]["nixl_GBps"], sv["large"]["sv_GBps"]
    print(f"RESULT nixl_gbps={x:.3f} shared_volume_gbps={y:.3f} ratio={x / y:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
