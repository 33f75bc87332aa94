"""Shared-volume connector vs vLLM's ECExampleConnector, same workload, same directory, one run.

    python -m benchmarks.connector_throughput [--large 30] [--small 200] [--rounds 3] [--dir /path]

Items: "large" is a real image embedding (1,300 tokens x 3,584 wide, bf16,
about 9.3 MB); "small" is the tiny model's (64 x 128). Reported per item:

- save: time on the caller's path (the encoder step). The example writes
  synchronously; ours hands the tensor to the background writer (host tensors
  by reference). With a CUDA device present, the large items' saves are timed
  again from device memory (ours: the copy queued on a side stream into staging
  memory; the example: its synchronous ``.cpu()`` + write), printed on the
  DEVICE line; without one that line is absent.
- load: time on the step path until the tensor is usable in memory. The
  example's safetensors load maps the file lazily, so it is followed by a
  copy (what a GPU upload would read); it is timed among ours and raw, each
  time right after the same untimed pin + verification of the item as they
  get, so all three run under the same conditions. Also reported: the example
  timed as session 6 did (one loop of loads right after its saves, nothing in
  between: torch's threads stay awake from one clone to the next, which makes
  it faster), and both back to back (every item pinned and verified first,
  then one load after another, as in a step with several items; then the
  example's loads likewise). Ours is the worker's step-path entry, ``start_load_caches`` with
  the one item (its per-step work included), reading into a reused buffer of
  the worker's pool (the tensor is dropped after each check, as vLLM frees an
  item, so its buffer serves the next load; the first load, which makes the
  buffer, is reported apart). Warm: right after our verification read the
  entry, which is when a consumer loads. Also: ours with the pool off (a fresh
  tensor per load: the first-touch faults) and ours cold (the file's pages
  dropped with posix_fadvise DONTNEED after the verification). Our checksum
  verification runs before that, on the scheduler's thread pool (off the step
  path); its time is reported separately, not hidden.
- raw: the same files, whole, with one read loop and no checks, into touched
  anonymous memory with huge pages advised (the kind the pool's slots are):
  the page cache's limit (warm) and the disk's (cold). Every raw read follows
  the same untimed pin + verification as a load of that item (so it finds the
  same cache state). Also reported: raw into a touched bytearray (session 5's
  raw: 4 KiB pages, and much noisier across processes).
- order: the warm reads of an item (ours, raw, the example, ours without the
  pool, raw into a bytearray) run in a random order, seeded (the same orders
  in every run): the step just before matters, and a fixed rotation would
  always put the same one before each. Medians by the step before are printed.

With ``--rdma STEPS`` only the rdma producer's saves are timed (no shared volume, no
example): ``STEPS`` steps of ``--rdma-items`` large CPU outputs each, through the rdma
worker (``start_save_caches`` and one ``save_caches`` per item, as vLLM calls them) into
a region on /dev/shm. Reported per step (medians): ``step_ms``, the time those calls
held the step; ``wait_ms``, from their return until every slot's header was READY,
which is what the scheduler's ``request_finished`` waits for before it can announce
them (0 where the step writes them itself); and ``total_ms``, the two together. Printed
on an RDMA line; it runs against whichever connector is on the path (an older commit's
from a ``git archive`` copy gives the before).

Last line: RESULT save_block_ratio=<ours/example> load_ratio=<example/ours>
fraction_of_raw=<ours load GB/s / raw GB/s, warm> fraction_of_raw_cold=<the same,
cold>, all from the large items (medians).
"""

from __future__ import annotations

import argparse
import collections
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.stats import median_ms, rank_quantile
from encoderpool_connector.shared_volume.entry import Expect, entry_name
from encoderpool_connector.shared_volume.metadata import LoadSpec, SharedVolumeMetadata
from encoderpool_connector.shared_volume.store import Pins, SharedStore
from encoderpool_connector.shared_volume.worker import (
    DEFAULT_LOAD_BUFFER_BYTES,
    DEFAULT_SAVE_STAGING_BYTES,
    BackgroundWriter,
    SharedVolumeWorker,
    writer_stats,
)
from encoderpool_contracts import ConnectorConfig

FP = "0123456789abcdef"


def example_connector(root: str, metadata: Any) -> Any:
    """vLLM's ECExampleConnector methods bound to a stand-in ``self`` (no engine needed)."""
    from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

    me = types.SimpleNamespace(is_producer=True, is_consumer=True, _storage_path=root)
    for name in ("_generate_foldername_debug", "_generate_filename_debug", "save_caches"):
        setattr(me, name, getattr(ECExampleConnector, name).__get__(me))
    me.start_load_caches = ECExampleConnector.start_load_caches.__get__(me)
    me._get_connector_metadata = lambda: metadata
    return me


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes, compared by numpy on this thread: a torch op between two timed reads
    wakes torch's thread pool, whose spinning threads steal the 2nd core from the next read."""
    return bool(np.array_equal(a.view(torch.uint8).numpy(), b.view(torch.uint8).numpy()))


def consumer_worker(
    store: SharedStore, buffer_bytes: int, load_threads: int | None
) -> SharedVolumeWorker:
    sv: dict[str, Any] = {
        "root": store.root,
        "capacity_bytes": store.capacity_bytes,
        "load_buffer_bytes": buffer_bytes,
    }
    if load_threads is not None:  # unset: the connector's default (and older code runs)
        sv["load_threads"] = load_threads
    config = ConnectorConfig.from_extra_config(
        {"transport": "sharedVolume", "model_fingerprint": FP, "shared_volume": sv}
    )
    worker = SharedVolumeWorker(config, store, is_producer=False, is_consumer=True)
    worker._device = torch.device("cpu")
    return worker


def touched_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous memory with huge pages advised, every page touched: what the pool's slots
    are, so that raw and ours copy into the same kind of memory (a bytearray from malloc
    is 4 KiB pages, and its speed swung by +-25% from one process to the next)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    memoryview(region)[:] = b"\1" * nbytes
    return region


def read_whole(path: str, buf: bytearray | mmap.mmap) -> None:
    """The raw limit: the whole file into a touched buffer, one read loop, no checks."""
    fd = os.open(path, os.O_RDONLY)
    try:
        view = memoryview(buf)
        done = 0
        while done < len(view):
            k = os.readv(fd, [view[done:]])
            if not k:
                break
            done += k
    finally:
        os.close(fd)


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: str) -> None:
    """Evict the file's (clean) pages from the page cache: the next read goes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def room_for(n: int, nbytes: int) -> int:
    """Staging bytes for ``n`` saves of ``nbytes`` at once (each range page aligned)."""
    return max(DEFAULT_SAVE_STAGING_BYTES, n * (-(-nbytes // 4096) * 4096))


def device_saves(
    n: int, shape: tuple[int, int], root: Path, device: torch.device
) -> dict[str, float]:
    """Ours and the example's save of ``n`` outputs held in ``device`` memory, on the step
    (on CUDA ours queues the copy; its writer waits for it)."""
    from vllm.distributed.ec_transfer.ec_connector.example_connector import (
        ECExampleConnectorMetadata,
    )

    gen = torch.Generator(device=device).manual_seed(0)
    outs = {
        f"dev-{i:04d}": torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
        for i in range(n)
    }
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ex_root = root / "example-device"
    ex_root.mkdir()
    ex = example_connector(str(ex_root), ECExampleConnectorMetadata())
    ex_save = [timed(lambda h=h: ex.save_caches(outs, h)) for h in outs]
    store = SharedStore(str(root / "ours-device"), capacity_bytes=1 << 40, eviction="lru")
    store.prepare_producer()
    stats = writer_stats()
    nbytes = shape[0] * shape[1] * 2
    writer = BackgroundWriter(
        store, FP, maxsize=max(64, n), stats=stats, staging_bytes=room_for(n, nbytes)
    )
    ours_save = [timed(lambda h=h: writer.submit(h, outs[h])) for h in outs]
    writer.flush()
    writer.close()
    assert stats.totals.data.get("published") == n, stats.totals.data
    return {"example_save_ms": median_ms(ex_save), "ours_save_ms": median_ms(ours_save)}


def rdma_saves(steps: int, per_step: int, shape: tuple[int, int], shm_dir: str) -> dict[str, float]:
    """The rdma producer worker's saves of ``per_step`` CPU outputs a step (see the module
    docstring); the outputs are made once and saved again under new keys every step."""
    from encoderpool_connector.rdma.buffer import (
        HEADER_BYTES,
        SharedRegion,
        align,
        unpack_slot_header,
    )
    from encoderpool_connector.rdma.metadata import RdmaMetadata, WritePlan
    from encoderpool_connector.rdma.worker import RdmaWorker

    nbytes = shape[0] * shape[1] * 2
    slot = align(HEADER_BYTES + nbytes)
    region_bytes = max(1 << 20, per_step * slot)
    region = SharedRegion.create(shm_dir, region_bytes)
    config = ConnectorConfig.from_extra_config(
        {
            "transport": "rdma",
            "model_fingerprint": FP,
            "rdma": {"shm_dir": shm_dir, "buffer_bytes": region_bytes},
        }
    )
    worker = RdmaWorker(config, is_producer=True, is_consumer=False)
    worker._device = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    outs = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(per_step)]

    def ready(plans: list[Any]) -> bool:
        for plan in plans:
            raw = region.view[plan.offset : plan.offset + HEADER_BYTES]
            header = unpack_slot_header(raw)
            if header is None or header.generation != plan.generation:
                return False
        return True

    step_s, wait_s = [], []
    try:
        for step in range(steps):
            plans = [
                WritePlan(
                    f"rdma-{step}-{i}", i * slot, slot - HEADER_BYTES, step * per_step + i + 1
                )
                for i in range(per_step)
            ]
            meta = RdmaMetadata(region=region.path, region_bytes=region.size, writes=plans)
            cache = {plan.mm_hash: out for plan, out in zip(plans, outs, strict=True)}
            t0 = time.perf_counter()
            worker.start_save_caches({}, meta)  # this step encodes them: none cached yet
            for plan in plans:
                worker.save_caches(cache, plan.mm_hash)
            t1 = time.perf_counter()
            while not ready(plans):
                time.sleep(0.0002)
            t2 = time.perf_counter()
            step_s.append(t1 - t0)
            wait_s.append(t2 - t1)
    finally:
        worker.shutdown()
        region.close()
    totals = dict(worker.stats.totals.data)
    assert totals.get("saves") == steps * per_step, totals
    return {
        "step_ms": median_ms(step_s),
        "wait_ms": median_ms(wait_s),
        "total_ms": median_ms([a + b for a, b in zip(step_s, wait_s, strict=True)]),
    }


def run(
    kind: str,
    n: int,
    shape: tuple[int, int],
    root: Path,
    rounds: int,
    load_threads: int | None = None,
) -> dict[str, float]:
    from vllm.distributed.ec_transfer.ec_connector.example_connector import (
        ECExampleConnectorMetadata,
        MMMeta,
    )

    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"{kind}-{i:04d}": torch.randn(shape, generator=gen).to(torch.bfloat16) for i in range(n)
    }
    nbytes = shape[0] * shape[1] * 2

    # --- vLLM's example connector ---
    ex_root = root / f"example-{kind}"
    ex_root.mkdir()
    meta = ECExampleConnectorMetadata()
    ex = example_connector(str(ex_root), meta)
    ex_save = [timed(lambda h=h: ex.save_caches(tensors, h)) for h in tensors]

    def example_load(h: str) -> float:
        """One timed load of ``h`` by the example (map + clone), checked after."""
        meta.mm_datas = [MMMeta(h, shape[0])]
        cache: dict[str, torch.Tensor] = {}

        def load() -> None:
            ex.start_load_caches(cache)
            cache[h] = cache[h].clone()  # make it resident: the lazy map read in full

        took = timed(load)
        assert same(cache[h], tensors[h])
        return took

    # Session 6's way, kept for comparison: one loop right after the saves.
    ex_load_alone = [example_load(h) for h in tensors]

    # --- ours ---
    ours_root = root / f"ours-{kind}"
    store = SharedStore(str(ours_root), capacity_bytes=1 << 40, eviction="lru")
    store.prepare_producer()
    stats = writer_stats()
    # Every save is queued before the writer writes one: room for them all, so that each
    # is timed and none dropped.
    writer = BackgroundWriter(
        store, FP, maxsize=max(64, n), stats=stats, staging_bytes=room_for(n, nbytes)
    )
    t_all = time.perf_counter()
    ours_save = [timed(lambda h=h: writer.submit(h, tensors[h])) for h in tensors]
    writer.flush()
    drain_s = time.perf_counter() - t_all
    writer.close()
    assert stats.totals.data.get("published") == n, stats.totals.data
    paths = {h: store.entry_path(entry_name(FP, h)) for h in tensors}
    for path in paths.values():
        fsync(path)  # clean pages, so that DONTNEED can drop them for the cold runs

    pins = Pins(store)
    worker = consumer_worker(store, DEFAULT_LOAD_BUFFER_BYTES, load_threads)
    # The pool off: every load faults in a fresh tensor.
    fresh = consumer_worker(store, 0, load_threads)
    size = os.path.getsize(paths[next(iter(tensors))])
    raw_buf = touched_buffer(size)  # the same kind of memory the pool's slots are
    raw_ba = bytearray(size)  # session 5's raw destination, kept for comparison
    memoryview(raw_ba)[:] = b"\1" * size

    def prepare(h: str) -> LoadSpec:
        """What precedes every timed read, ours or raw: the scheduler's pin and full
        verification (which reads the whole entry: that is why a load finds it warm)."""
        pin = pins.pin(entry_name(FP, h))
        assert pin is not None
        v = store.verify(pins.subdir, pin, Expect(h, FP, "bfloat16", shape[0], shape[1]))
        return LoadSpec(h, pins.subdir, pin, True, "bfloat16", shape, v.inode, v.offset)

    def load(w: SharedVolumeWorker, h: str, cold: bool = False) -> float:
        """One timed load of item ``h`` through ``w``'s step-path entry point, from a fresh
        pin, checked after."""
        spec = prepare(h)
        if cold:
            drop_cache(paths[h])
        return load_prepared(w, h, spec)

    def load_prepared(w: SharedVolumeWorker, h: str, spec: LoadSpec) -> float:
        cache: dict[str, torch.Tensor] = {}
        meta = SharedVolumeMetadata(loads=[spec])
        took = timed(lambda: w.start_load_caches(cache, meta))
        w.build_connector_worker_meta()  # the step's report: the worker forgets the pin
        pins.drop(spec.name)  # the scheduler side's part once the step is reported
        assert same(cache[h], tensors[h])
        return took  # ``cache`` dies here: vLLM freeing the item, its buffer is reused

    def raw_read(h: str, buf: bytearray | mmap.mmap, cold: bool = False) -> float:
        spec = prepare(h)  # the same preparation, so neither side skips its effects
        if cold:
            drop_cache(paths[h])
        took = timed(lambda: read_whole(paths[h], buf))
        pins.drop(spec.name)
        return took

    def example_read(h: str) -> float:
        """The example after the same untimed preparation as ours and raw (the item's
        pin and verification), in the same rotation."""
        spec = prepare(h)
        took = example_load(h)
        pins.drop(spec.name)
        return took

    verify, ours, raw, raw_bytearray, ours_fresh, ours_cold, raw_cold = ([] for _ in range(7))
    ex_load: list[float] = []
    series = {
        "ours": ours,
        "raw": raw,
        "ours_fresh": ours_fresh,
        "raw_bytearray": raw_bytearray,
        "example": ex_load,
    }
    # A fresh random order per item (the same orders in every run): a fixed rotation keeps
    # which step runs before which, and the step before matters (after the example's
    # clone, torch's threads may still hold the second core).
    shuffle = random.Random(0).shuffle
    after: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for i, h in enumerate(list(tensors) * rounds):
        expect = Expect(h, FP, "bfloat16", shape[0], shape[1])
        pin = pins.pin(entry_name(FP, h))
        assert pin is not None
        verify.append(timed(lambda pin=pin, expect=expect: store.verify(pins.subdir, pin, expect)))
        store.unlink(pins.subdir, pin)
        # Warm, as a consumer loads: its scheduler just read the whole entry to verify it.
        warm: dict[str, Callable[[], float]] = {
            "ours": lambda h=h: load(worker, h),
            "raw": lambda h=h: raw_read(h, raw_buf),
            "ours_fresh": lambda h=h: load(fresh, h),
            "raw_bytearray": lambda h=h: raw_read(h, raw_ba),
            "example": lambda h=h: example_read(h),
        }
        names = list(warm)
        shuffle(names)
        before = "first"
        for name in names:
            took = warm[name]()
            series[name].append(took)
            if not (name == "ours" and len(ours) == 1):  # the first makes the buffer
                after[name, before].append(took)
            before = name
        # Cold: the file's pages dropped from the page cache after the verification.
        cold = [
            lambda h=h: ours_cold.append(load(worker, h, cold=True)),
            lambda h=h: raw_cold.append(raw_read(h, raw_buf, cold=True)),
        ]
        for step in cold[i % 2 :] + cold[: i % 2]:
            step()
    # Back to back, as session 6 timed the example and as a step with several items loads:
    # every item pinned and verified first, then the loads one after another with only the
    # check between them; then the example's loads the same way.
    specs = {h: prepare(h) for h in tensors}
    ours_b2b = [load_prepared(worker, h, specs[h]) for h in tensors]
    ex_b2b = [example_load(h) for h in tensors]
    pins.close()
    first_load = ours[0]  # includes making (and touching) the pool's first buffer
    ours = ours[1:] if len(ours) > 1 else ours

    gbps = nbytes / 1e9
    res = {
        "example_save_ms": median_ms(ex_save),
        "ours_save_ms": median_ms(ours_save),
        "ours_writer_GBps": n * gbps / drain_s,
        "example_load_ms": median_ms(ex_load),
        "example_load_alone_ms": median_ms(ex_load_alone),
        "example_load_b2b_ms": median_ms(ex_b2b),
        "ours_load_b2b_ms": median_ms(ours_b2b),
        "ours_load_ms": median_ms(ours),
        "ours_load_first_ms": first_load * 1e3,
        "ours_load_fresh_ms": median_ms(ours_fresh),
        "ours_load_cold_ms": median_ms(ours_cold),
        "ours_verify_ms": median_ms(verify),
        "raw_read_ms": median_ms(raw),
        "raw_read_bytearray_ms": median_ms(raw_bytearray),
        "raw_read_cold_ms": median_ms(raw_cold),
        "example_load_GBps": gbps / statistics.median(ex_load),
        "ours_load_GBps": gbps / statistics.median(ours),
        "ours_load_fresh_GBps": gbps / statistics.median(ours_fresh),
        "ours_load_cold_GBps": gbps / statistics.median(ours_cold),
        "ours_verify_GBps": gbps / statistics.median(verify),
        "raw_read_GBps": gbps / statistics.median(raw),
        "raw_read_bytearray_GBps": gbps / statistics.median(raw_bytearray),
        "raw_read_cold_GBps": gbps / statistics.median(raw_cold),
        "ours_load_p25_ms": rank_quantile(ours, 0.25) * 1e3,
        "raw_read_p25_ms": rank_quantile(raw, 0.25) * 1e3,
        "ours_load_p90_ms": rank_quantile(ours, 0.9) * 1e3,
        "raw_read_p90_ms": rank_quantile(raw, 0.9) * 1e3,
        # Each load against the raw read of the same item right beside it: less exposed
        # to other processes' load changing during the run.
        "raw_over_ours_paired": statistics.median(
            r / o for r, o in zip(raw[1:], ours, strict=True)
        ),
    }
    print(f"{kind}: {n} items of {shape[0]}x{shape[1]} bf16 ({nbytes / 1e6:.2f} MB)")
    for k, v in res.items():
        print(f"  {k:20s} {v:10.4f}")
    print("  median ms by the step just before (warm; count in brackets):")
    for name in ("ours", "raw", "example"):
        cells = [
            f"{b} {median_ms(after[name, b]):.3f} [{len(after[name, b])}]"
            for b in ["first", *series]
            if b != name and after[name, b]
        ]
        print(f"    {name:8s} after: " + ", ".join(cells))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--large", type=int, default=30)
    p.add_argument("--small", type=int, default=200)
    p.add_argument(
        "--rounds", type=int, default=3, help="Loads and raw reads of each item (warm and cold)."
    )
    p.add_argument("--dir", type=Path, default=None, help="Directory on the filesystem to test.")
    p.add_argument(
        "--load-threads",
        type=int,
        default=None,
        help="shared_volume.load_threads of our consumer (default: unset, the connector's).",
    )
    p.add_argument(
        "--rdma",
        type=int,
        default=0,
        metavar="STEPS",
        help="Time only the rdma producer's saves, this many steps (see above).",
    )
    p.add_argument("--rdma-items", type=int, default=8, help="Large outputs per rdma step.")
    args = p.parse_args(argv)
    if args.rdma:
        with tempfile.TemporaryDirectory(prefix="ep-bench-rdma-", dir="/dev/shm") as d:
            r = rdma_saves(args.rdma, args.rdma_items, (1300, 3584), d)
        print(
            f"RDMA items_per_step={args.rdma_items} step_ms={r['step_ms']:.3f} "
            f"wait_ms={r['wait_ms']:.3f} total_ms={r['total_ms']:.3f}"
        )
        return 0
    with tempfile.TemporaryDirectory(prefix="ep-bench-", dir=args.dir) as d:
        small = run("small", args.small, (64, 128), Path(d), args.rounds, args.load_threads)
        large = run("large", args.large, (1300, 3584), Path(d), args.rounds, args.load_threads)
        device = (
            device_saves(
                args.large, (1300, 3584), Path(d), torch.device("cuda", torch.cuda.current_device())
            )
            if torch.cuda.is_available()
            else None
        )
    del small
    # Back to back (both sides), and the example as session 6 timed it: not the target.
    print(
        "NOTE "
        f"load_ratio_back_to_back={large['example_load_b2b_ms'] / large['ours_load_b2b_ms']:.3f} "
        f"load_ratio_example_after_saves="
        f"{large['example_load_alone_ms'] / large['ours_load_ms']:.3f}"
    )
    if device is not None:
        print(
            "DEVICE "
            f"save_block_ratio={device['ours_save_ms'] / device['example_save_ms']:.4f} "
            f"ours_save_ms={device['ours_save_ms']:.4f} "
            f"example_save_ms={device['example_save_ms']:.4f}"
        )
    print(
        "RESULT "
        f"save_block_ratio={large['ours_save_ms'] / large['example_save_ms']:.4f} "
        f"load_ratio={large['example_load_ms'] / large['ours_load_ms']:.3f} "
        f"fraction_of_raw={large['ours_load_GBps'] / large['raw_read_GBps']:.3f} "
        f"fraction_of_raw_cold={large['ours_load_cold_GBps'] / large['raw_read_cold_GBps']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
