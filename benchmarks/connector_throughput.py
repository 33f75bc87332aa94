"""Shared-volume connector vs vLLM's ECExampleConnector, same workload, same directory, one run.

    python -m benchmarks.connector_throughput [--large 30] [--small 200] [--dir /path]

Items: "large" is a real image embedding (1,300 tokens x 3,584 wide, bf16,
about 9.3 MB); "small" is the tiny model's (64 x 128). Reported per item:

- save: time on the caller's path (the encoder step). The example writes
  synchronously; ours hands the tensor to the background writer.
- load: time on the step path until the tensor is usable in memory. The
  example's safetensors load maps the file lazily, so it is followed by a
  copy (what a GPU upload would read); ours reads straight into the tensor.
  Our checksum verification runs before that, on the scheduler's thread pool
  (off the step path); its time is reported separately, not hidden.
- raw: reading the same files into a preallocated buffer with one syscall
  loop, the filesystem's (page cache's) limit for a load.

Last line: RESULT save_block_ratio=<ours/example> load_ratio=<example/ours>
fraction_of_raw=<ours load GB/s / raw GB/s>, all from the large items.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from encoderpool_connector.shared_volume.entry import Expect, entry_name
from encoderpool_connector.shared_volume.metadata import LoadSpec
from encoderpool_connector.shared_volume.store import Pins, SharedStore
from encoderpool_connector.shared_volume.worker import (
    BackgroundWriter,
    SharedVolumeWorker,
    writer_stats,
)

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


def med_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def run(kind: str, n: int, shape: tuple[int, int], root: Path) -> dict[str, float]:
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
    ex_load = []
    for h in tensors:
        meta.mm_datas = [MMMeta(h, shape[0])]
        cache: dict[str, torch.Tensor] = {}

        def load(cache: dict[str, torch.Tensor] = cache, h: str = h) -> None:
            ex.start_load_caches(cache)
            cache[h] = cache[h].clone()  # make it resident: the lazy map read in full

        ex_load.append(timed(load))
        assert torch.equal(cache[h], tensors[h])

    # --- ours ---
    ours_root = root / f"ours-{kind}"
    store = SharedStore(str(ours_root), capacity_bytes=1 << 40, eviction="lru")
    store.prepare_producer()
    stats = writer_stats()
    writer = BackgroundWriter(store, FP, maxsize=max(64, n), stats=stats)
    t_all = time.perf_counter()
    ours_save = [timed(lambda h=h: writer.submit(h, tensors[h])) for h in tensors]
    writer.flush()
    drain_s = time.perf_counter() - t_all
    writer.close()
    assert stats.totals.data.get("published") == n, stats.totals.data

    pins = Pins(store)
    worker = SharedVolumeWorker.__new__(SharedVolumeWorker)
    worker.stats, worker._failed, worker._device = writer_stats(), set(), torch.device("cpu")
    worker.store = store
    ours_verify, ours_load = [], []
    for h in tensors:
        name = entry_name(FP, h)
        pin = pins.pin(name)
        assert pin is not None
        expect = Expect(h, FP, "bfloat16", shape[0], shape[1])
        ours_verify.append(
            timed(lambda pin=pin, expect=expect: store.verify(pins.subdir, pin, expect))
        )
        inode = store.verify(pins.subdir, pin, expect)[1]
        spec = LoadSpec(h, pins.subdir, pin, True, "bfloat16", shape, inode)
        out: list[torch.Tensor] = []
        ours_load.append(timed(lambda spec=spec, out=out: out.append(worker._load(spec))))
        assert torch.equal(out[0], tensors[h])
    pins.close()

    # --- raw read of the same files: the limit ---
    raw = []
    buf = bytearray(os.path.getsize(store.entry_path(entry_name(FP, next(iter(tensors))))))
    for h in tensors:
        path = store.entry_path(entry_name(FP, h))

        def read(path: str = path) -> None:
            with open(path, "rb", buffering=0) as f:
                view = memoryview(buf)
                done = 0
                while done < len(view):
                    k = f.readinto(view[done:])
                    if not k:
                        break
                    done += k

        raw.append(timed(read))

    gbps = nbytes / 1e9
    res = {
        "example_save_ms": med_ms(ex_save),
        "ours_save_ms": med_ms(ours_save),
        "ours_writer_GBps": n * gbps / drain_s,
        "example_load_ms": med_ms(ex_load),
        "ours_load_ms": med_ms(ours_load),
        "ours_verify_ms": med_ms(ours_verify),
        "raw_read_ms": med_ms(raw),
        "example_load_GBps": gbps / statistics.median(ex_load),
        "ours_load_GBps": gbps / statistics.median(ours_load),
        "ours_verify_GBps": gbps / statistics.median(ours_verify),
        "raw_read_GBps": gbps / statistics.median(raw),
    }
    print(f"{kind}: {n} items of {shape[0]}x{shape[1]} bf16 ({nbytes / 1e6:.2f} MB)")
    for k, v in res.items():
        print(f"  {k:20s} {v:10.4f}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--large", type=int, default=30)
    p.add_argument("--small", type=int, default=200)
    p.add_argument("--dir", type=Path, default=None, help="Directory on the filesystem to test.")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ep-bench-", dir=args.dir) as d:
        small = run("small", args.small, (64, 128), Path(d))
        large = run("large", args.large, (1300, 3584), Path(d))
    del small
    print(
        "RESULT "
        f"save_block_ratio={large['ours_save_ms'] / large['example_save_ms']:.4f} "
        f"load_ratio={large['example_load_ms'] / large['ours_load_ms']:.3f} "
        f"fraction_of_raw={large['ours_load_GBps'] / large['raw_read_GBps']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
