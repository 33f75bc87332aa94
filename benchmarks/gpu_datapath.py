"""The shared-volume connector's data path on a GPU: saves from, loads to the device, side by side.

    python -m benchmarks.gpu_datapath [--tokens 2304] [--width 3584] [--batch 8] [--iters 10]
                                      [--dir /path] [--stand-in-vllm] [--no-models]

Items are bfloat16 encoder outputs, by default Qwen2-VL-7B's for one 1344x1344
image (2,304 tokens x 3,584 wide, 16.5 MB). Reported per item, medians over
``--iters`` steps of ``--batch`` items (docs/benchmarks-gpu.md says what each
figure means):

- save on the step: the time ``save_caches`` holds the encoder step, the
  encoder's work already done (synchronized before the timer). Ours: the copy
  into the writer's staging pool, queued on the copy stream. The previous way:
  ``tensor.to("cpu", non_blocking=True)`` plus an event (torch pins fresh host
  memory whenever its cache has no free block). The example's way (vLLM's
  ECExampleConnector): ``safetensors.torch.save_file({"ec_cache": t.cpu()})``,
  synchronous. Also: ours until written (the writer thread's time per item).
- load: until the item is usable on the device (synchronized), per item of a
  step of ``--batch`` items. Ours: ``start_load_caches`` after the scheduler
  side's pin and verification (untimed, as in a consumer). Raw: one thread,
  one read of the payload into pinned memory, a synchronous copy to the device.
  The example's way: ``safetensors.torch.load_file(path, device=...)``.
- H2D bandwidth, pinned and pageable (256 MiB), and on CUDA the encode time of
  Qwen2-VL-7B's vision tower for that image and the prefill time of a 7B-class
  LM (Qwen2-VL-7B's, 28 layers) over 2,368 tokens, random weights; "no device"
  without CUDA.

Without CUDA it runs as a smoke (small items, few iterations: what
tests/test_benchmarks_gpu.py runs). Without vLLM (or with ``--stand-in-vllm``)
the vLLM base classes the worker imports are stood in, here only; the output
says which.

Last line: RESULT gpu_save_block_ratio=<ours save on the step / example's save>
gpu_load_ratio=<example load / ours> gpu_fraction_of_raw=<raw load / ours>
encode_over_load=<encode time / our load time> (nan where not measured).
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from benchmarks.stats import median_ms

FP = "0123456789abcdef"
MiB = 1 << 20
# One 1344x1344 image through Qwen2-VL-7B: 96x96 patches of 14 px, merged 2x2.
IMAGE_PATCHES = (96, 96)
PREFILL_TOKENS = 2368  # that image's 2,304 tokens and a 64-token prompt


# ---- vLLM, or stand-ins for the base classes the worker imports ----

_STOOD_IN = (
    "vllm",
    "vllm.distributed",
    "vllm.distributed.ec_transfer",
    "vllm.distributed.ec_transfer.ec_connector",
    "vllm.distributed.ec_transfer.ec_connector.base",
    "vllm.distributed.ec_transfer.ec_connector.metrics",
)


def stand_in_vllm() -> None:
    """Modules with vLLM's ECConnectorMetadata, ECConnectorWorkerMetadata, ECConnectorStats
    (and the Prometheus base the stats module names): what the worker's imports need."""
    mods = {name: types.ModuleType(name) for name in _STOOD_IN}
    for name, mod in mods.items():
        mod.__path__ = []  # a package, so the next level imports from it
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mod)

    class ECConnectorMetadata(abc.ABC):  # noqa: B024  # as vLLM's
        pass

    class ECConnectorWorkerMetadata(abc.ABC):
        @abc.abstractmethod
        def aggregate(self, other: Any) -> Any: ...

    @dataclasses.dataclass
    class ECConnectorStats:
        data: dict[str, Any] = dataclasses.field(default_factory=dict)

    class ECConnectorPromMetrics:
        def __init__(self, *args: Any) -> None:
            pass

    base = mods["vllm.distributed.ec_transfer.ec_connector.base"]
    base.ECConnectorMetadata = ECConnectorMetadata  # type: ignore[attr-defined]
    base.ECConnectorWorkerMetadata = ECConnectorWorkerMetadata  # type: ignore[attr-defined]
    metrics = mods["vllm.distributed.ec_transfer.ec_connector.metrics"]
    metrics.ECConnectorStats = ECConnectorStats  # type: ignore[attr-defined]
    metrics.ECConnectorPromMetrics = ECConnectorPromMetrics  # type: ignore[attr-defined]
    metrics.PromMetric = object  # type: ignore[attr-defined]
    metrics.PromMetricT = TypeVar("PromMetricT")  # type: ignore[attr-defined]
    sys.modules.update(mods)


def vllm_or_stand_ins(force: bool) -> str:
    """Import vLLM's base classes, or stand them in; says which."""
    if not force:
        try:
            import vllm
            from vllm.distributed.ec_transfer.ec_connector import base, metrics  # noqa: F401

            return f"vLLM {vllm.__version__} (its own base classes)"
        except ImportError:
            pass
    stand_in_vllm()
    why = "asked to" if force else "vLLM is not installed"
    return f"vLLM's EC connector base classes stood in ({why}; this benchmark only)"


# ---- measuring ----


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_item(fn: Callable[[], Any], n: int, device: torch.device) -> float:
    """Seconds per item of ``fn`` (which handles ``n`` items), ending when the device is."""
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) / n


@dataclasses.dataclass
class Figures:
    """Milliseconds per item (or GB/s where named), nan where not measured."""

    save_ours: float = math.nan
    save_ours_first: float = math.nan
    save_ours_busy: float = math.nan
    save_previous: float = math.nan
    save_previous_first: float = math.nan
    save_example: float = math.nan
    written_ours: float = math.nan
    load_ours: float = math.nan
    load_raw: float = math.nan
    load_example: float = math.nan
    h2d_pinned_gbs: float = math.nan
    h2d_pageable_gbs: float = math.nan
    encode: float = math.nan
    prefill: float = math.nan
    dropped: int = 0


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) and not math.isnan(b) else math.nan


def result_line(f: Figures) -> str:
    return (
        f"RESULT gpu_save_block_ratio={ratio(f.save_ours, f.save_example):.4f} "
        f"gpu_load_ratio={ratio(f.load_example, f.load_ours):.4f} "
        f"gpu_fraction_of_raw={ratio(f.load_raw, f.load_ours):.4f} "
        f"encode_over_load={ratio(f.encode, f.load_ours):.4f}"
    )


def parse_result(line: str) -> dict[str, float]:
    """The RESULT line's values by name (``nan`` parses as nan)."""
    head, *pairs = line.split()
    if head != "RESULT":
        raise ValueError(f"not a RESULT line: {line!r}")
    return {k: float(v) for k, v in (p.split("=", 1) for p in pairs)}


# ---- the example connector's way (vLLM 0.32's ECExampleConnector, its calls alone) ----


def example_save(path: str, t: torch.Tensor) -> None:
    import safetensors.torch

    safetensors.torch.save_file({"ec_cache": t.detach().cpu()}, path)


def example_load(path: str, device: torch.device) -> torch.Tensor:
    import safetensors.torch

    t: torch.Tensor = safetensors.torch.load_file(path, device=str(device))["ec_cache"]
    return t


# ---- saves and loads ----


def outputs(
    n: int, shape: tuple[int, int], device: torch.device, step: int
) -> dict[str, torch.Tensor]:
    """``n`` fresh encoder outputs, as one encoder step leaves them."""
    gen = torch.Generator(device=device).manual_seed(step)
    return {
        f"s{step:03d}-{i}": torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
        for i in range(n)
    }


def saves_and_loads(args: argparse.Namespace, device: torch.device, root: Path, f: Figures) -> None:
    from encoderpool_connector.shared_volume.entry import Expect, entry_name, read_payload
    from encoderpool_connector.shared_volume.metadata import LoadSpec, SharedVolumeMetadata
    from encoderpool_connector.shared_volume.store import Pins, SharedStore
    from encoderpool_connector.shared_volume.worker import SharedVolumeWorker
    from encoderpool_contracts import ConnectorConfig

    shape = (args.tokens, args.width)
    nbytes = shape[0] * shape[1] * 2
    store = SharedStore(str(root / "ours"), 1 << 40, "lru")
    config = ConnectorConfig.from_extra_config(
        {
            "transport": "sharedVolume",
            "model_fingerprint": FP,
            "shared_volume": {"root": store.root, "capacity_bytes": 1 << 40, "writer_queue": 4096},
        }
    )
    producer = SharedVolumeWorker(config, store, is_producer=True, is_consumer=False)
    consumer = SharedVolumeWorker(config, store, is_producer=False, is_consumer=True)
    producer._device = consumer._device = device
    writer = producer.writer
    assert writer is not None
    ex_dir = root / "example"
    ex_dir.mkdir()

    def ours(outs: dict[str, torch.Tensor]) -> None:
        for h in outs:
            producer.save_caches(outs, h)

    kept: list[Any] = []  # the previous way's host copies stay queued until written

    def previous(outs: dict[str, torch.Tensor]) -> None:
        for t in outs.values():
            host = t.detach().to("cpu", non_blocking=True)
            ready = torch.Event() if device.type != "cpu" else None
            if ready is not None:
                ready.record()
            kept.append((host, ready))

    def example(outs: dict[str, torch.Tensor]) -> None:
        for h, t in outs.items():
            example_save(str(ex_dir / f"{h}.safetensors"), t)

    ways: dict[str, tuple[Callable[[dict[str, torch.Tensor]], None], list[float]]] = {
        "ours": (ours, []),
        "previous": (previous, []),
        "example": (example, []),
    }
    saved: list[str] = []
    for step in range(args.iters):
        names = list(ways)
        names = names[step % 3 :] + names[: step % 3]  # no way always right after another
        for name in names:
            outs = outputs(args.batch, shape, device, step)
            sync(device)  # the encoder's work is done: only the save's own time is timed
            fn, times = ways[name]
            t0 = time.perf_counter()
            fn(outs)
            times.append((time.perf_counter() - t0) / len(outs))
            if name == "ours":
                saved += list(outs)
            sync(device)
            writer.flush()  # untimed: the next step starts with the writer idle
            kept.clear()
    # Ours again, back to back: the writer still writing the previous steps' items (the
    # step thread then shares the GIL with it; a full pool drops, counted).
    busy = []
    for step in range(args.iters):
        outs = outputs(args.batch, shape, device, 1000 + step)
        sync(device)
        t0 = time.perf_counter()
        ours(outs)
        busy.append((time.perf_counter() - t0) / len(outs))
    sync(device)
    writer.flush()
    f.save_ours_busy = median_ms(busy)
    f.save_ours, f.save_previous, f.save_example = (median_ms(ways[n][1]) for n in ways)
    f.save_ours_first, f.save_previous_first = (
        ways["ours"][1][0] * 1e3,
        ways["previous"][1][0] * 1e3,
    )
    totals = writer.stats.totals.data
    f.dropped = int(totals.get("saves_dropped", 0))
    published = int(totals.get("published", 0))
    f.written_ours = totals.get("write_seconds", math.nan) / max(published, 1) * 1e3

    # Loads: a step of --batch items each way, from entries written above (warm).
    pins = Pins(store)
    expect_tokens, expect_width = shape
    pinned = device.type == "cuda"
    raw_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    raw_np = raw_buf.numpy()
    loads: dict[str, list[float]] = {"ours": [], "raw": [], "example": []}
    groups = [saved[i : i + args.batch] for i in range(0, len(saved), args.batch)]
    groups = [g for g in groups if len(g) == args.batch]
    for step, group in enumerate(groups):
        specs = []
        for h in group:  # the scheduler side's part, untimed: pin, verify (reads it all)
            pin = pins.pin(entry_name(FP, h))
            assert pin is not None
            _, inode, offset = store.verify(
                pins.subdir, pin, Expect(h, FP, "bfloat16", expect_tokens, expect_width)
            )
            specs.append(LoadSpec(h, pins.subdir, pin, True, "bfloat16", shape, inode, offset))

        def load_ours(specs: list[LoadSpec] = specs) -> None:
            cache: dict[str, torch.Tensor] = {}
            consumer.start_load_caches(cache, SharedVolumeMetadata(loads=specs))
            assert len(cache) == len(specs), "a load failed"

        def load_raw(specs: list[LoadSpec] = specs) -> None:
            for spec in specs:
                fd = os.open(os.path.join(pins.dir, spec.name), os.O_RDONLY)
                try:
                    read_payload(fd, raw_np, spec.offset, nbytes)
                finally:
                    os.close(fd)
                if device.type != "cpu":
                    raw_buf.to(device)  # synchronous: the buffer is reused by the next read

        def load_example(group: list[str] = group) -> None:
            for h in group:
                example_load(str(ex_dir / f"{h}.safetensors"), device)

        runs: dict[str, Callable[[], None]] = {
            "ours": load_ours,
            "raw": load_raw,
            "example": load_example,
        }
        names = list(runs)
        for name in names[step % 3 :] + names[: step % 3]:
            loads[name].append(per_item(runs[name], len(group), device))
        consumer.build_connector_worker_meta()
        for spec in specs:
            pins.drop(spec.name)
    f.load_ours, f.load_raw, f.load_example = (
        median_ms(loads[n]) for n in ("ours", "raw", "example")
    )
    producer.shutdown()
    consumer.shutdown()
    pins.close()


def h2d_bandwidth(device: torch.device, f: Figures) -> None:
    if device.type != "cuda":
        return
    n = 256 * MiB
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    for pin in (True, False):
        src = torch.ones(n, dtype=torch.uint8, pin_memory=pin)
        times = []
        for _ in range(6):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            times.append(time.perf_counter() - t0)
        gbs = n / statistics.median(times[1:]) / 1e9
        if pin:
            f.h2d_pinned_gbs = gbs
        else:
            f.h2d_pageable_gbs = gbs


# ---- real-size models, random weights ----


def vision_tower(device: torch.device, dtype: torch.dtype, **config: Any) -> Any:
    """Qwen2-VL's vision tower (transformers), at Qwen2-VL-7B's size unless ``config``
    says otherwise; random weights, nothing downloaded."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    with torch.device(device):
        return Qwen2VisionTransformerPretrainedModel._from_config(
            Qwen2VLVisionConfig(**config), dtype=dtype
        ).eval()


def language_model(device: torch.device, dtype: torch.dtype, **config: Any) -> Any:
    """A 7B-class LM (Qwen2-VL-7B's: 28 layers, 3,584 wide, GQA 28/4) unless ``config``
    says otherwise; random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    size: dict[str, Any] = {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
    }
    with torch.device(device):
        return Qwen2ForCausalLM._from_config(Qwen2Config(**{**size, **config}), dtype=dtype).eval()


def encode_once(tower: Any, patches: tuple[int, int], device: torch.device) -> torch.Tensor:
    """One image of ``patches`` through the tower; its merged embedding (tokens x width)."""
    c = tower.config
    dim = c.in_channels * c.temporal_patch_size * c.patch_size**2
    x = torch.randn(patches[0] * patches[1], dim, device=device, dtype=tower.dtype)
    grid = torch.tensor([[1, patches[0], patches[1]]], device=device)
    with torch.no_grad():
        out: torch.Tensor = tower(x, grid_thw=grid).pooler_output
    return out


def prefill_once(lm: Any, tokens: int, device: torch.device) -> torch.Tensor:
    ids = torch.randint(0, lm.config.vocab_size, (1, tokens), device=device)
    with torch.no_grad():
        logits: torch.Tensor = lm(input_ids=ids, logits_to_keep=1, use_cache=False).logits
    return logits


def timed_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return median_ms(times)


def encode_ms(device: torch.device) -> float:
    tower = vision_tower(device, torch.bfloat16)
    return timed_ms(lambda: encode_once(tower, IMAGE_PATCHES, device), device)


def prefill_ms(device: torch.device) -> float:
    lm = language_model(device, torch.bfloat16)
    return timed_ms(lambda: prefill_once(lm, PREFILL_TOKENS, device), device)


def models(device: torch.device, f: Figures) -> None:
    """Each model built, timed and freed in turn (the LM alone is 15 GB in bfloat16)."""
    if device.type != "cuda":
        return
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: no encode or prefill figures")
        return
    print(f"transformers {transformers.__version__}; random weights, bfloat16")
    f.encode = encode_ms(device)
    torch.cuda.empty_cache()
    f.prefill = prefill_ms(device)
    torch.cuda.empty_cache()


# ---- report ----


def show(label: str, value: float, unit: str = "ms", no_device: bool = False) -> str:
    if math.isnan(value):
        return f"  {label:<48} {'no device' if no_device else 'not measured'}"
    return f"  {label:<48} {value:10.3f} {unit}"


def report(f: Figures, device: torch.device, nbytes: int) -> list[str]:
    mb = nbytes / 1e6
    cpu = device.type != "cuda"
    return [
        f"per item ({mb:.2f} MB), median over steps:",
        show("save on the step: ours (staging + copy stream)", f.save_ours),
        show("save on the step: ours, first step", f.save_ours_first),
        show("save on the step: ours, back to back", f.save_ours_busy),
        show("save on the step: previous (to cpu non_blocking)", f.save_previous),
        show("save on the step: previous, first step", f.save_previous_first),
        show("save on the step: example (safetensors, sync)", f.save_example),
        show("ours until written (writer thread)", f.written_ours),
        f"  saves dropped (ours): {f.dropped}",
        show("load until usable on the device: ours", f.load_ours),
        show("load: raw (one thread, read + pinned copy)", f.load_raw),
        show("load: example (safetensors load_file)", f.load_example),
        show("H2D pinned", f.h2d_pinned_gbs, "GB/s", no_device=cpu),
        show("H2D pageable", f.h2d_pageable_gbs, "GB/s", no_device=cpu),
        show("encode: Qwen2-VL-7B vision tower, 96x96 patches", f.encode, no_device=cpu),
        show(f"prefill: 7B-class LM, {PREFILL_TOKENS} tokens", f.prefill, no_device=cpu),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tokens", type=int, default=2304 if cuda else 64)
    p.add_argument("--width", type=int, default=3584 if cuda else 1024)
    p.add_argument("--batch", type=int, default=8 if cuda else 4, help="items per step")
    p.add_argument("--iters", type=int, default=10 if cuda else 3, help="steps per way")
    p.add_argument("--dir", default=None, help="where entries go (default: a temp dir)")
    p.add_argument("--stand-in-vllm", action="store_true", help="never import vLLM")
    p.add_argument("--no-models", action="store_true", help="skip the encode/prefill models")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    )
    device = device or torch.device("cpu")
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print(f"torch {torch.__version__}; {vllm_or_stand_ins(args.stand_in_vllm)}")
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    from encoderpool_connector.shared_volume.split import default_threads

    print(f"cpus usable: {cpus}; read threads per large load: {default_threads()}")
    print(
        f"items: {args.tokens} x {args.width} bfloat16; {args.batch} per step; {args.iters} steps"
    )
    if device.type != "cuda":
        print("no CUDA device: a CPU smoke (small items; no H2D, encode or prefill figures)")
    f = Figures()
    root = Path(tempfile.mkdtemp(prefix="ep-gpu-", dir=args.dir))
    try:
        saves_and_loads(args, device, root, f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    h2d_bandwidth(device, f)
    if not args.no_models:
        models(device, f)
    for line in report(f, device, args.tokens * args.width * 2):
        print(line)
    print(result_line(f), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
