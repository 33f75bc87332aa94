"""Does the pool pay? An EPD pool vs monolithic vLLM, same request stream, equal devices, one run.

    python -m benchmarks.epd_serving [--scale 1] [--plot docs/epd_serving.png]
    python -m benchmarks.epd_serving --device cuda --devices 0,1 --model /models/Qwen2-VL-7B \\
        --image-size 896 --engine-args "--max-num-seqs 64 --kv-cache-memory-bytes 20000000000"

Arms, all behind the same router process (``encoderpool_router``), all started
together and measured in turns on every workload:

- ``pool-sharedVolume``: one producer + one consumer with our shared-volume
  connector; the router as deployed for it (``--reuse-encoded-s``).
- ``pool-rdma``: the same with our NIXL transport (UCX over tcp/sm here); every
  item goes to a producer (the consumer needs its params).
- ``pool-<transport>-whenFaster`` (``--dispatch always,when-faster``): the same pool,
  servers and store of its own, its router with ``--dispatch when-faster`` and
  ``--encode-seconds`` as the operator renders it (``--encode-seconds`` here; default:
  the arm's producer's median warm round trip for a new image, timed before its router
  starts, where the operator passes the width Job's encode time). Printed side by side
  with the ``always`` arm of its transport; ``--mono-replicas ''`` leaves the monolithic
  arms out when only the dispatch policies are compared.
- ``mono-RxK``: R monolithic replicas of K devices each (prefix caching and
  their own encoder caches on, as vLLM defaults) behind the router with
  ``--consumer-policy media-affinity`` (``--consumer-policy`` here): the same
  first image reaches the same replica, whose caches then hit, until that
  replica holds ``--consumer-load-bound`` requests (default: its share of the
  closed-loop clients, ``ceil(concurrency / R)``). ``mono-1x2``, one replica
  on every device, is the monolith with perfect affinity; both are measured and
  the better one is the baseline per figure. Pool arms with more than one
  consumer get the same policy (those built here have one).

Devices: on CPU every vLLM process tree is pinned with ``taskset`` and its
worker threads with ``VLLM_CPU_OMP_THREADS_BIND``; the pool gets the first
``--producer-devices`` devices for its producer and the rest for its consumer,
each monolithic layout splits the same devices evenly. The router and this
client are not pinned and are the same for every arm (their CPU time is
reported). On ``--device cuda`` the devices are GPU ids (CUDA_VISIBLE_DEVICES).

Workloads (sizes scale with ``--scale``; images are deterministic PNGs, the
same index the same bytes; every workload uses images no other one uses):
``unique`` (one new image per request), ``zipf`` (few images shared by many
clients, Zipf-distributed, a different question each), ``multi4`` (four new
images per request), all closed-loop with ``--concurrency`` clients; and
``mixed``: text-only streams decode back to back while heavy requests (several
new images) arrive on a fixed schedule. Requests stream (SSE); TTFT and TPOT
are measured here, per request, with ``ignore_eos`` so every answer has
exactly ``max_tokens`` tokens. Also measured: each component's CPU busy share
per workload, and on an idle system the encode time of one image, a request's
TTFT with and without its image cached, and a decode step.

Last line: ``RESULT ttft_p50_ratio=<zipf> tpot_p99_ratio=<mixed, decode streams>
throughput_ratio=<multi4>``, pool (``--headline`` transport) / best monolithic layout;
with no monolithic arm, ``DISPATCH`` lines instead: when-faster / always per workload.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.stats import CLK_TCK, cpu_seconds, group_cpu_seconds, percentile
from e2e.media import chat_request, encoder_request, image, image_part
from e2e.vllm_server import VllmServer, base_env, ec_transfer_config, free_port
from encoderpool_contracts.signals import PRODUCER_ITEM_SECONDS
from encoderpool_router.policy import CONSUMER_CHOICES

# --- workloads (pure: no engines) ----------------------------------------------------------


@dataclass(frozen=True)
class Req:
    """One request of a stream: which images (by index), what it asks, how long it answers."""

    images: tuple[int, ...]
    text: str
    max_tokens: int
    role: str = "main"  # mixed: "decode" (background streams) or "heavy"
    at_s: float | None = None  # arrival offset (open loop); None: sent by a closed-loop client


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Req, ...]
    concurrency: int  # closed-loop clients
    # mixed: closed-loop clients go round their list again until every timed request is done
    loop_until_timed_done: bool = False


@dataclass(frozen=True)
class Sizes:
    """Request counts and lengths; ``scaled`` multiplies the counts."""

    unique: int = 12
    zipf: int = 32
    zipf_images: int = 8
    zipf_s: float = 1.1
    multi4: int = 8
    images_per_multi: int = 4
    mixed_heavy: int = 6
    mixed_heavy_images: int = 2
    mixed_streams: int = 2
    mixed_gap_s: float = 0.8
    concurrency: int = 4
    max_tokens: int = 16
    decode_tokens: int = 64

    def scaled(self, k: float) -> Sizes:
        def n(v: int) -> int:
            return max(1, round(v * k))

        return Sizes(
            unique=n(self.unique),
            zipf=n(self.zipf),
            zipf_images=n(self.zipf_images),
            zipf_s=self.zipf_s,
            multi4=n(self.multi4),
            images_per_multi=self.images_per_multi,
            mixed_heavy=n(self.mixed_heavy),
            mixed_heavy_images=self.mixed_heavy_images,
            mixed_streams=self.mixed_streams,
            mixed_gap_s=self.mixed_gap_s,
            concurrency=self.concurrency,
            max_tokens=self.max_tokens,
            decode_tokens=self.decode_tokens,
        )


QUESTIONS = (
    "Describe this image.",
    "What is in the picture?",
    "What color is it?",
    "Describe the shape.",
    "What is red, green or blue here?",
)

# Image index ranges, one per workload, so no workload finds another's images cached.
BASE = {"warm": 900_000, "calib": 800_000, "unique": 100_000, "zipf": 200_000}
BASE.update({"multi4": 300_000, "mixed": 400_000})


def zipf_ranks(n: int, k: int, s: float, seed: int) -> list[int]:
    """``n`` draws from ranks 0..k-1 with P(rank r) proportional to 1 / (r + 1)^s."""
    weights = [1.0 / (r + 1) ** s for r in range(k)]
    return random.Random(seed).choices(range(k), weights=weights, k=n)


def workloads(sizes: Sizes, seed: int = 15) -> list[Workload]:
    """The four workloads every arm gets, identical for every arm."""
    z = sizes
    unique = tuple(
        Req((BASE["unique"] + i,), QUESTIONS[i % len(QUESTIONS)], z.max_tokens)
        for i in range(z.unique)
    )
    zipf = tuple(
        Req((BASE["zipf"] + r,), f"Client {i}: {QUESTIONS[i % len(QUESTIONS)]}", z.max_tokens)
        for i, r in enumerate(zipf_ranks(z.zipf, z.zipf_images, z.zipf_s, seed))
    )
    multi = tuple(
        Req(
            tuple(BASE["multi4"] + i * z.images_per_multi + j for j in range(z.images_per_multi)),
            QUESTIONS[i % len(QUESTIONS)],
            z.max_tokens,
        )
        for i in range(z.multi4)
    )
    streams = tuple(
        Req(
            (),
            f"Stream {i}: tell a long story about red, green and blue.",
            z.decode_tokens,
            "decode",
        )
        for i in range(z.mixed_streams)
    )
    heavy = tuple(
        Req(
            tuple(
                BASE["mixed"] + i * z.mixed_heavy_images + j for j in range(z.mixed_heavy_images)
            ),
            QUESTIONS[i % len(QUESTIONS)],
            4,
            "heavy",
            at_s=0.5 + i * z.mixed_gap_s,
        )
        for i in range(z.mixed_heavy)
    )
    return [
        Workload("unique", unique, z.concurrency),
        Workload("zipf", zipf, z.concurrency),
        Workload("multi4", multi, z.concurrency),
        Workload("mixed", streams + heavy, z.mixed_streams, loop_until_timed_done=True),
    ]


def request_body(req: Req, image_size: int) -> dict[str, Any]:
    """The streaming chat request for ``req`` (greedy, exactly ``max_tokens`` tokens)."""
    pngs = [image(i, (image_size, image_size)) for i in req.images]
    body = chat_request(*pngs, text=req.text, max_tokens=req.max_tokens, stream=True)
    body["ignore_eos"] = True
    body["stream_options"] = {"include_usage": True}
    return body


# --- what one request measured, and statistics -------------------------------------------


@dataclass
class Record:
    role: str
    start: float  # perf_counter at send
    token_times: list[float] = field(default_factory=list)  # one entry per token
    end: float = 0.0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for one-token answers)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


def tokens_in_chunk(chunk: dict[str, Any]) -> int:
    """Output tokens one SSE chunk carries (vLLM's ``token_ids`` when sent, else its text)."""
    n = 0
    for choice in chunk.get("choices") or ():
        ids = choice.get("token_ids")
        if ids is not None:
            n += len(ids)
        elif (choice.get("delta") or {}).get("content"):
            n += 1
    return n


def sse_events(lines: Sequence[bytes]) -> Iterator[dict[str, Any] | None]:
    """The JSON events of SSE ``data:`` lines; ``None`` for ``[DONE]``."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield None
            continue
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError(f"SSE event is not an object: {data[:200]!r}")
        yield event


@dataclass(frozen=True)
class Summary:
    n: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    itl_p99: float
    rps: float


def summarize(records: Sequence[Record], ttft_role: str, tpot_role: str) -> Summary:
    """TTFT over ``ttft_role`` requests, TPOT and ITL over ``tpot_role``'s, requests/s over all."""
    ttfts = [r.ttft for r in records if r.role == ttft_role]
    tpots = [t for r in records if r.role == tpot_role and (t := r.tpot) is not None]
    itls = [x for r in records if r.role == tpot_role for x in r.itls]
    span = max(r.end for r in records) - min(r.start for r in records) if records else 0.0
    return Summary(
        n=len(records),
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50),
        tpot_p99=percentile(tpots, 99),
        itl_p99=percentile(itls, 99),
        rps=len(records) / span if span > 0 else float("nan"),
    )


# Which requests each workload's figures come from: (TTFT role, TPOT role).
ROLES = {"mixed": ("heavy", "decode")}


def workload_summary(name: str, records: Sequence[Record]) -> Summary:
    ttft_role, tpot_role = ROLES.get(name, ("main", "main"))
    return summarize(records, ttft_role, tpot_role)


METRICS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "rps")
LOWER_IS_BETTER = {"ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99"}


def best_baseline(per_arm: dict[str, Summary], metric: str) -> tuple[str, float]:
    """The monolithic arm that did best on ``metric`` (lowest latency, highest throughput)."""
    vals = {a: getattr(s, metric) for a, s in per_arm.items()}
    pick = min if metric in LOWER_IS_BETTER else max
    arm = pick(vals, key=lambda a: vals[a])
    return arm, vals[arm]


def ratios(
    results: dict[str, dict[str, Summary]], pool_arm: str, mono_arms: Sequence[str]
) -> dict[str, dict[str, float]]:
    """pool / best monolithic layout, per workload and metric."""
    out: dict[str, dict[str, float]] = {}
    for wl, per_arm in results.items():
        monos = {a: per_arm[a] for a in mono_arms if a in per_arm}
        out[wl] = {}
        for m in METRICS:
            _, base = best_baseline(monos, m)
            mine = getattr(per_arm[pool_arm], m)
            out[wl][m] = mine / base if base else float("nan")
    return out


def pair_ratios(
    results: dict[str, dict[str, Summary]], arm: str, base: str
) -> dict[str, dict[str, float]]:
    """``arm`` / ``base`` (two pool arms, e.g. when-faster / always), per workload and metric."""
    out: dict[str, dict[str, float]] = {}
    for wl, per_arm in results.items():
        mine, theirs = per_arm[arm], per_arm[base]
        out[wl] = {}
        for m in METRICS:
            b = getattr(theirs, m)
            out[wl][m] = getattr(mine, m) / b if b else float("nan")
    return out


def result_line(r: dict[str, dict[str, float]], prefix: str = "RESULT") -> str:
    return (
        f"{prefix} ttft_p50_ratio={r['zipf']['ttft_p50']:.2f} "
        f"tpot_p99_ratio={r['mixed']['tpot_p99']:.2f} "
        f"throughput_ratio={r['multi4']['rps']:.2f}"
    )


# --- the client ------------------------------------------------------------------------------


async def send(session: Any, url: str, req: Req, body: dict[str, Any]) -> Record:
    """POST one streaming request; timestamps every token as its chunk arrives."""
    rec = Record(req.role, time.perf_counter())
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            text = await resp.text()
            raise RuntimeError(f"POST {url} -> {resp.status}: {text[:500]}")
        usage = None
        async for raw in resp.content:
            now = time.perf_counter()
            for event in sse_events([raw]):
                if event is None:
                    continue
                if "error" in event:
                    raise RuntimeError(f"stream from {url} broke: {event['error']}")
                rec.token_times.extend([now] * tokens_in_chunk(event))
                usage = event.get("usage") or usage
    rec.end = time.perf_counter()
    got = len(rec.token_times)
    if got != req.max_tokens or (usage and usage.get("completion_tokens") != req.max_tokens):
        raise RuntimeError(
            f"{url}: asked for {req.max_tokens} tokens, streamed {got}, usage {usage}"
        )
    return rec


async def run_workload(url: str, wl: Workload, image_size: int) -> list[Record]:
    """Closed-loop clients for untimed requests, timed arrivals for the rest; all records."""
    import aiohttp

    bodies = {id(r): request_body(r, image_size) for r in wl.requests}  # built before timing
    closed = [r for r in wl.requests if r.at_s is None]
    timed = [r for r in wl.requests if r.at_s is not None]
    records: list[Record] = []
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        timed_left = len(timed)
        queue = list(reversed(closed))

        async def closed_client(k: int) -> None:
            if wl.loop_until_timed_done:  # client k owns stream k: its own list, looped
                mine = closed[k :: wl.concurrency]
                i = 0
                while i < len(mine) or timed_left:
                    r = mine[i % len(mine)]
                    records.append(await send(session, url, r, bodies[id(r)]))
                    i += 1
                return
            while queue:
                r = queue.pop()
                records.append(await send(session, url, r, bodies[id(r)]))

        async def timed_client(r: Req, t0: float) -> None:
            nonlocal timed_left
            assert r.at_s is not None
            await asyncio.sleep(max(0.0, t0 + r.at_s - time.perf_counter()))
            try:
                records.append(await send(session, url, r, bodies[id(r)]))
            finally:
                timed_left -= 1

        t0 = time.perf_counter()
        n_closed = min(wl.concurrency, len(closed))
        await asyncio.gather(
            *(closed_client(k) for k in range(n_closed)),
            *(timed_client(r, t0) for r in timed),
        )
    return records


# --- CPU accounting ---------------------------------------------------------------------------


def host_cpu() -> float:
    """CPU seconds the whole machine spent busy (all cores), from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


# --- arms ----------------------------------------------------------------------------------------


@dataclass
class PinnedServer(VllmServer):
    """A ``vllm serve`` whose whole process tree runs on ``cpus`` (taskset), when set."""

    cpus: str = ""
    extra: Sequence[str] = ()

    def command(self) -> list[str]:
        cmd = [*super().command(), *self.extra]
        return ["taskset", "-c", self.cpus, *cmd] if self.cpus else cmd


@dataclass
class Arm:
    name: str
    servers: dict[str, PinnedServer]  # component -> server
    router_args: list[str]
    policy: list[str] = field(default_factory=list)  # consumer-policy flags, in router_args too
    router: Any = None  # RouterProcess, once started
    dispatch: str = "always"  # the pool's --dispatch
    encode_s: float = 0.0  # when-faster: --encode-seconds for images (0: timed at start)

    @property
    def url(self) -> str:
        assert self.router is not None
        return str(self.router.url)

    def encodes(self) -> dict[str, int]:
        """Images each server has encoded so far (vLLM's DEBUG line per encoder run)."""
        from tests.router.fixtures import ENCODED_LINE

        return {c: s.log_text().count(ENCODED_LINE) for c, s in self.servers.items()}

    def routed(self) -> dict[str, float]:
        """The router's counters: where items were encoded, producer failures, and how
        each consumer attempt was chosen (media-affinity: how often it spilled over)."""
        r = self.router
        out = {
            kind: r.metric("encoderpool_router_media_items_total", encoded=kind)
            for kind in ("remote", "local", "reused")
        }
        for kind in ("producer_timeout", "producer_error", "producer_unavailable"):
            out[kind] = r.metric("encoderpool_router_errors_total", kind=kind)
        for choice in CONSUMER_CHOICES:
            out[choice] = r.metric("encoderpool_router_consumer_choices_total", choice=choice)
        return out

    def cpu(self) -> dict[str, float]:
        out = {
            comp: group_cpu_seconds(s.proc.pid)
            for comp, s in self.servers.items()
            if s.proc is not None
        }
        if self.router is not None and self.router.proc is not None:
            out["router"] = cpu_seconds(self.router.proc.pid)
        return out


@dataclass(frozen=True)
class Placement:
    producer: tuple[str, ...]
    consumer: tuple[str, ...]
    mono: dict[int, tuple[tuple[str, ...], ...]]  # replicas -> devices of each replica


def place(devices: Sequence[str], producer_devices: int, mono_replicas: Sequence[int]) -> Placement:
    """Split ``devices`` between producer and consumer, and evenly across monolithic replicas.

    One device only: producer and consumer share it (a single GPU, memory split by
    the caller's engine args).
    """
    devs: tuple[str, ...] = tuple(devices)
    if not devs:
        raise ValueError("--devices: give at least one device (CPU core or GPU id)")
    if len(devs) == 1:
        prod: tuple[str, ...] = devs
        cons: tuple[str, ...] = devs
    else:
        if not 1 <= producer_devices < len(devs):
            raise ValueError(
                f"--producer-devices {producer_devices}: must leave the consumer at least one "
                f"of the {len(devs)} devices {','.join(devs)}"
            )
        prod, cons = devs[:producer_devices], devs[producer_devices:]
    mono = {}
    for r in mono_replicas:
        if r < 1 or len(devs) % r:
            raise ValueError(f"--mono-replicas {r}: must divide the {len(devs)} devices evenly")
        k = len(devs) // r
        mono[r] = tuple(devs[i * k : (i + 1) * k] for i in range(r))
    return Placement(prod, cons, mono)


def encoder_width(model: Path) -> int:
    """The encoder's output width (the LM hidden size for Qwen2-VL-style models)."""
    cfg = json.loads((model / "config.json").read_text())
    width = (cfg.get("text_config") or {}).get("hidden_size") or cfg.get("hidden_size")
    if not isinstance(width, int):
        raise ValueError(f"{model}/config.json: no text_config.hidden_size; pass --encoder-width")
    return width


def connector_configs(
    model: Path, store: Path, width: int, store_bytes: int, rdma_bytes: int
) -> dict[str, tuple[str, str, dict[str, Any], dict[str, str]]]:
    """Per transport: connector class, module, extra config, extra env (as the operator renders)."""
    import vllm

    from encoderpool_contracts import CHANNEL_KEY_ENV, ConnectorConfig, ModelIdentity

    fp = ModelIdentity(model=str(model), vllm_version=str(vllm.__version__)).fingerprint()
    sv = ConnectorConfig(
        transport="sharedVolume",
        model_fingerprint=fp,
        encoder_output_widths={"image": width},
        shared_volume={"root": str(store), "capacity_bytes": store_bytes},
    ).to_extra_config()
    rdma = ConnectorConfig(
        transport="rdma",
        model_fingerprint=fp,
        encoder_output_widths={"image": width},
        rdma={
            "side_channel_port": free_port(),
            "buffer_bytes": rdma_bytes,
            "bind_host": "127.0.0.1",
        },
    ).to_extra_config()
    rdma_env = {
        "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"),
        "ENCODERPOOL_ADVERTISE_HOST": "127.0.0.1",
        CHANNEL_KEY_ENV: "epd-benchmark-channel-key-0123456789",
    }
    return {
        "sharedVolume": (
            "EncoderPoolSharedVolumeConnector",
            "encoderpool_connector.shared_volume",
            sv,
            {},
        ),
        "rdma": ("EncoderPoolNixlConnector", "encoderpool_connector.rdma", rdma, rdma_env),
    }


ENCODER_LOGGER = "vllm.v1.worker.gpu_model_runner"


def consumer_policy_flags(
    consumers: int, policy: str, load_bound: int, concurrency: int
) -> list[str]:
    """The router flags choosing among ``consumers`` (none for one: nothing to choose).

    ``load_bound`` 0: each consumer's share of the closed-loop clients, so a hot image
    fills its own replica to that share and then the next in its ranking, instead of
    queueing every client on one replica while the others idle.
    """
    if consumers < 2:
        return []
    flags = ["--consumer-policy", policy]
    if policy == "media-affinity":
        bound = load_bound or -(-concurrency // consumers)
        flags += ["--consumer-load-bound", str(bound)]
    return flags


def build_arms(args: argparse.Namespace, model: Path, work: Path) -> list[Arm]:
    placement = place(args.devices.split(","), args.producer_devices, args.mono_replicas)
    extra = shlex.split(args.engine_args)
    cuda = args.device == "cuda"

    def server(name: str, devs: Sequence[str], more: Sequence[str] = (), env: Any = None) -> Any:
        e = base_env(None if cuda else ",".join(devs))
        if cuda:
            e.pop("VLLM_TARGET_DEVICE", None)
            e["CUDA_VISIBLE_DEVICES"] = ",".join(devs)
        e.update(env or {})
        e["VLLM_LOGGING_CONFIG_PATH"] = str(logging_config)
        return PinnedServer(
            name=name,
            model=model,
            log_path=work / f"{name}.log",
            env=e,
            cpus="" if cuda else ",".join(devs),
            extra=[*more, *extra],
        )

    # The model runner at DEBUG logs one line per encoder run: encodes are counted from it.
    from tests.connector.fixtures import LOGGING_CONFIG

    logging_config = work / "logging.json"
    base: dict[str, Any] = LOGGING_CONFIG
    loggers = {"vllm": base["loggers"]["vllm"], ENCODER_LOGGER: {"level": "DEBUG"}}
    formatter = dict(base["formatters"]["vllm"])
    formatter["format"] = "%(asctime)s " + formatter["format"]
    logging_config.write_text(
        json.dumps({**LOGGING_CONFIG, "formatters": {"vllm": formatter}, "loggers": loggers})
    )
    arms: list[Arm] = []
    width = args.encoder_width or encoder_width(model)
    for transport, dispatch in itertools.product(args.transports, args.dispatch):
        name = pool_arm(transport, dispatch)
        # A store of its own: an arm must not find the entries another arm's producer wrote.
        store = work / "ec" / name
        store.mkdir(parents=True, exist_ok=True)
        specs = connector_configs(model, store, width, args.store_bytes, args.rdma_bytes)
        cls, module, extra_cfg, env = specs[transport]
        p_ec = ec_transfer_config(cls, "ec_producer", extra_cfg, module)
        c_ec = ec_transfer_config(cls, "ec_consumer", extra_cfg, module)
        producer = server(
            f"{name}-producer", placement.producer, ["--ec-transfer-config", p_ec], env
        )
        consumer = server(
            f"{name}-consumer", placement.consumer, ["--ec-transfer-config", c_ec], env
        )
        flags = ["--producers", producer.url, "--consumers", consumer.url]
        if transport == "sharedVolume":
            flags += ["--reuse-encoded-s", "600"]
        if dispatch != "always":
            flags += ["--dispatch", dispatch]
        servers = {"producer": producer, "consumer": consumer}
        arms.append(Arm(name, servers, flags, dispatch=dispatch, encode_s=args.encode_seconds))
    for r, groups in placement.mono.items():
        k = len(groups[0])
        name = f"mono-{r}x{k}"
        replicas = {f"replica{i}": server(f"{name}-{i}", g) for i, g in enumerate(groups)}
        urls = ",".join(s.url for s in replicas.values())
        policy = consumer_policy_flags(
            r, args.consumer_policy, args.consumer_load_bound, args.concurrency
        )
        arms.append(Arm(name, replicas, ["--consumers", urls, *policy], policy))
    return arms


def pool_arm(transport: str, dispatch: str) -> str:
    """``pool-sharedVolume`` (always, the deployed default), ``pool-sharedVolume-whenFaster``."""
    name = f"pool-{transport}"
    return name if dispatch == "always" else f"{name}-whenFaster"


def describe_placement(arms: Sequence[Arm]) -> list[str]:
    lines = []
    for arm in arms:
        parts = []
        for comp, s in arm.servers.items():
            where = s.cpus or s.env.get("CUDA_VISIBLE_DEVICES", "?")
            parts.append(f"{comp} on {'cores' if s.cpus else 'GPUs'} {where}")
        policy = f"; router {' '.join(arm.policy)}" if arm.policy else ""
        if arm.dispatch != "always":
            policy += f"; router --dispatch {arm.dispatch}"
        lines.append(f"  {arm.name}: {'; '.join(parts)}; router and client unpinned{policy}")
    return lines


@contextlib.contextmanager
def started(arms: Sequence[Arm], work: Path, timeout: float, image_size: int) -> Iterator[None]:
    """Start every server at once (they load in parallel), then each arm's router; stop all."""
    from tests.router.fixtures import RouterProcess

    servers = [s for a in arms for s in a.servers.values()]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout)
        for a in arms:
            if a.dispatch == "when-faster":
                if not a.encode_s:
                    a.encode_s = producer_encode_s(a.servers["producer"].url, image_size)
                a.router_args += ["--encode-seconds", json.dumps({"image": a.encode_s})]
            router_log = work / f"router-{a.name}.log"
            a.router = RouterProcess([*a.router_args, "--log-level", "INFO"], router_log)
            a.router.start()
        yield
    finally:
        for a in arms:
            if a.router is not None:
                a.router.stop()
        for s in servers:
            s.stop()


# --- idle calibration: where a request's time goes ------------------------------------------


def post_time(url: str, body: dict[str, Any]) -> float:
    from e2e.vllm_server import post_json

    t = time.perf_counter()
    post_json(url + "/v1/chat/completions", body)
    return time.perf_counter() - t


def producer_encode_s(url: str, image_size: int) -> float:
    """What the operator would pass as ``--encode-seconds``, on this bench: the median of
    three warm round trips of a new image to an idle producer (after one to warm it),
    an upper bound of the width Job's encode time by the hop on loopback."""
    times = []
    for i in range(4):
        png = image(BASE["calib"] + 70 + i, (image_size, image_size))
        times.append(post_time(url, encoder_request(image_part(png))))
    return round(statistics.median(times[1:]), 4)


async def calibrate(arms: Sequence[Arm], image_size: int, max_tokens: int) -> dict[str, float]:
    """Idle-system figures: encode time of one image, TTFT fresh vs cached, a decode step."""
    out: dict[str, float] = {}
    pool = next((a for a in arms if "producer" in a.servers), None)
    mono = next((a for a in arms if a.name.startswith("mono")), None)
    if pool is not None:
        times = []
        for i in range(3):
            png = image(BASE["calib"] + 50 + i, (image_size, image_size))
            times.append(post_time(pool.servers["producer"].url, encoder_request(image_part(png))))
        out["producer_encode_ms"] = statistics.median(times) * 1e3
    if mono is not None:
        url = next(iter(mono.servers.values())).url
        import aiohttp

        async with aiohttp.ClientSession() as session:
            fresh, again, text, tpot = [], [], [], []
            for i in range(3):
                req = Req((BASE["calib"] + i,), "Describe this image.", max_tokens)
                body = request_body(req, image_size)
                fresh.append((await send(session, url, req, body)).ttft)
                again.append((await send(session, url, req, body)).ttft)
                treq = Req((), f"Calibration {i}: a story.", 32, "decode")
                rec = await send(session, url, treq, request_body(treq, image_size))
                text.append(rec.ttft)
                tpot.append(rec.tpot or 0.0)
        out["mono_ttft_fresh_image_ms"] = statistics.median(fresh) * 1e3
        out["mono_ttft_cached_image_ms"] = statistics.median(again) * 1e3
        out["mono_ttft_text_only_ms"] = statistics.median(text) * 1e3
        out["mono_decode_step_ms"] = statistics.median(tpot) * 1e3
        encode = out["mono_ttft_fresh_image_ms"] - out["mono_ttft_cached_image_ms"]
        whole = out["mono_ttft_fresh_image_ms"] + (max_tokens - 1) * out["mono_decode_step_ms"]
        out["encoder_share_of_unique_request"] = encode / whole if whole > 0 else float("nan")
    return out


def capacity_bound(
    calib: dict[str, float], images: int, max_tokens: int, producer: int, consumer: int
) -> dict[str, float]:
    """Requests/s each arm can sustain at most, from the idle calibration (a closed system).

    Per request, E = encoder seconds (images x (fresh - cached TTFT)) and D = the rest
    (cached TTFT + the decode steps). A pool does E on its ``producer`` devices and D on
    its ``consumer`` ones, so at most min(p/E, c/D); monolithic replicas do E + D on all
    p + c devices, (p + c)/(E + D). Their ratio is the most a pool can gain here.
    """
    e = images * (calib["mono_ttft_fresh_image_ms"] - calib["mono_ttft_cached_image_ms"]) / 1e3
    d = (calib["mono_ttft_cached_image_ms"] + (max_tokens - 1) * calib["mono_decode_step_ms"]) / 1e3
    pool = min(producer / e, consumer / d)
    mono = (producer + consumer) / (e + d)
    return {"encode_s": e, "rest_s": d, "pool_rps": pool, "mono_rps": mono, "ratio": pool / mono}


async def warm(arms: Sequence[Arm], image_size: int) -> None:
    """First requests pay one-time costs (allocation, lazy init): pay them before timing."""
    reqs = [
        Req((BASE["warm"],), "Describe this image.", 4),
        Req(tuple(BASE["warm"] + 1 + j for j in range(4)), "Describe these.", 4),
        Req((), "Warm up.", 8, "decode"),
    ]
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for arm in arms:
            urls = [arm.url]
            if len(arm.servers) > 1 and "producer" not in arm.servers:
                urls += [s.url for s in arm.servers.values()]  # every replica, not only one
            for url in urls:
                for r in reqs:
                    await send(session, url, r, request_body(r, image_size))


# --- output ------------------------------------------------------------------------------------


def fmt_ms(x: float) -> str:
    return f"{x * 1e3:8.1f}"


def print_tables(
    results: dict[str, dict[str, Summary]], cpu: dict[str, dict[str, dict[str, float]]]
) -> None:
    print(
        f"{'workload':>8} {'arm':>18} {'n':>3} {'ttft50':>8} {'ttft99':>8} {'tpot50':>8} "
        f"{'tpot99':>8} {'itl99':>8} {'req/s':>6}  cpu busy % (component)"
    )
    for wl, per_arm in results.items():
        for arm, s in per_arm.items():
            busy = " ".join(f"{c}={v:.0f}" for c, v in cpu[wl][arm].items())
            print(
                f"{wl:>8} {arm:>18} {s.n:>3} {fmt_ms(s.ttft_p50)} {fmt_ms(s.ttft_p99)} "
                f"{fmt_ms(s.tpot_p50)} {fmt_ms(s.tpot_p99)} {fmt_ms(s.itl_p99)} "
                f"{s.rps:6.2f}  {busy}"
            )
    print("(latencies in ms; mixed: TTFT of the heavy requests, TPOT/ITL of the decode streams)")


def print_ratios(name: str, r: dict[str, dict[str, float]], base: str = "") -> None:
    against = base or "best monolithic layout"
    print(f"ratios {name} / {against} (<1 better for latency, >1 for req/s):")
    print(f"{'workload':>8} " + " ".join(f"{m:>9}" for m in METRICS))
    for wl, row in r.items():
        print(f"{wl:>8} " + " ".join(f"{row[m]:9.2f}" for m in METRICS))


def plot(
    path: Path,
    by_pool: dict[str, dict[str, dict[str, float]]],
    title: str,
    what: str = "pool/mono",
) -> None:
    """Grouped bars of pool / monolithic (``what``) per workload and metric (Pillow: no
    extra packages)."""
    from PIL import Image, ImageDraw

    wls = list(next(iter(by_pool.values())))
    pools = list(by_pool)
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
    w, h, left, top, bottom = 1100, 520, 70, 60, 90
    im = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(im)
    vals = [v for p in by_pool.values() for row in p.values() for v in row.values() if v == v]
    ymax = max(2.0, min(6.0, max(vals, default=1.0) * 1.1))
    plot_h = h - top - bottom

    def y(v: float) -> float:
        return top + plot_h * (1 - min(v, ymax) / ymax)

    d.text((left, 15), title, fill="black")
    for tick in range(int(ymax * 2) + 1):
        v = tick / 2
        d.line([(left - 4, y(v)), (w - 20, y(v))], fill=(225, 225, 225))
        d.text((left - 40, y(v) - 6), f"{v:.1f}", fill="black")
    d.line([(left, y(1.0)), (w - 20, y(1.0))], fill="black", width=2)
    group_w = (w - left - 30) / len(wls)
    bar_w = group_w * 0.8 / (len(METRICS) * len(pools))
    for gi, wl in enumerate(wls):
        x0 = left + 10 + gi * group_w
        d.text((x0 + group_w * 0.3, h - bottom + 8), wl, fill="black")
        for mi, m in enumerate(METRICS):
            for pi, p in enumerate(pools):
                v = by_pool[p][wl][m]
                if v != v:  # NaN
                    continue
                bx = x0 + (mi * len(pools) + pi) * bar_w
                shade = colors[mi % len(colors)]
                if pi:  # second transport: lighter shade of the metric's colour
                    shade = tuple(c + (255 - c) // 2 for c in shade)  # type: ignore[assignment]
                d.rectangle([bx, y(v), bx + bar_w - 2, y(0)], fill=shade)
                if v > ymax:  # clipped: say how tall it is
                    d.text((bx, y(ymax) - 12), f"{v:.0f}", fill="black")
    ly = h - bottom + 30
    for mi, m in enumerate(METRICS):
        lx = left + mi * 150
        d.rectangle([lx, ly, lx + 12, ly + 12], fill=colors[mi])
        d.text((lx + 16, ly), m + (f" ({what})" if mi == 0 else ""), fill="black")
    legend = ", ".join(f"{p}: {'full' if i == 0 else 'light'} shade" for i, p in enumerate(pools))
    d.text((left, ly + 22), legend + "; black line: 1.0 (parity)", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path, format="PNG")


def machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, {platform.platform()}"


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="model dir (default: the encoder-heavy tiny model)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--devices", default="0,1", help="CPU cores or GPU ids, comma-separated")
    ap.add_argument("--producer-devices", type=int, default=1, help="the pool producer's share")
    ap.add_argument(
        "--mono-replicas",
        type=lambda s: [int(x) for x in s.split(",") if x.strip()],
        default=[2, 1],
        help="monolithic layouts: replica counts, each splitting --devices evenly; '': none "
        "(only the pool arms, e.g. to compare --dispatch policies)",
    )
    ap.add_argument(
        "--transports",
        type=lambda s: s.split(","),
        default=["sharedVolume", "rdma"],
        help="pool arms (sharedVolume, rdma)",
    )
    ap.add_argument("--headline", default="sharedVolume", help="the pool arm of the RESULT line")
    ap.add_argument(
        "--dispatch",
        type=lambda s: s.split(","),
        default=["always"],
        help="the pool routers' --dispatch: one arm per transport and policy "
        "(always, when-faster), measured side by side",
    )
    ap.add_argument(
        "--encode-seconds",
        type=float,
        default=0.0,
        help="when-faster arms: the routers' --encode-seconds for images; 0: each arm's "
        "producer's warm round trip for a new image, timed before its router starts",
    )
    ap.add_argument(
        "--consumer-policy",
        choices=["media-affinity", "least-busy"],
        default="media-affinity",
        help="the router's consumer policy in arms with several consumers (mono-2x1)",
    )
    ap.add_argument(
        "--consumer-load-bound",
        type=int,
        default=0,
        help="media-affinity's load bound; 0: ceil(--concurrency / consumers)",
    )
    ap.add_argument("--image-size", type=int, default=448, help="square image side, px")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every request count")
    ap.add_argument("--concurrency", type=int, default=Sizes.concurrency)
    ap.add_argument("--max-tokens", type=int, default=Sizes.max_tokens)
    ap.add_argument("--decode-tokens", type=int, default=Sizes.decode_tokens)
    ap.add_argument("--mixed-heavy-images", type=int, default=Sizes.mixed_heavy_images)
    ap.add_argument("--mixed-gap-s", type=float, default=Sizes.mixed_gap_s)
    ap.add_argument("--engine-args", default="", help="extra `vllm serve` args for every server")
    ap.add_argument("--encoder-width", type=int, default=0, help="default: from config.json")
    ap.add_argument("--store-bytes", type=int, default=1 << 30, help="shared volume capacity")
    ap.add_argument("--rdma-bytes", type=int, default=256 << 20, help="registered memory")
    ap.add_argument("--start-timeout", type=float, default=420.0)
    ap.add_argument("--plot", type=Path, help="write the ratio bar chart (PNG) here")
    ap.add_argument("--json", type=Path, help="write every figure (JSON) here")
    ap.add_argument("--work", type=Path, help="logs and the shared volume (default: a temp dir)")
    args = ap.parse_args(argv)
    bad = set(args.transports) - {"sharedVolume", "rdma"}
    if bad:
        ap.error(f"--transports: unknown {sorted(bad)}; use sharedVolume and/or rdma")
    bad = set(args.dispatch) - {"always", "when-faster"}
    if bad or len(set(args.dispatch)) != len(args.dispatch):
        ap.error(f"--dispatch {','.join(args.dispatch)}: give always and/or when-faster, once")
    if "always" not in args.dispatch:
        ap.error("--dispatch: include always (the headline and the side-by-side baseline)")
    if args.encode_seconds < 0:
        ap.error(f"--encode-seconds {args.encode_seconds}: give 0 (timed) or more")
    if args.consumer_load_bound < 0:
        ap.error(f"--consumer-load-bound {args.consumer_load_bound}: give 0 (automatic) or more")
    if f"pool-{args.headline}" not in {f"pool-{t}" for t in args.transports}:
        ap.error(f"--headline {args.headline}: not among --transports {args.transports}")
    return args


Measured = tuple[
    dict[str, dict[str, Summary]],
    dict[str, dict[str, dict[str, float]]],
    dict[str, dict[str, dict[str, int]]],
]


async def measure(arms: Sequence[Arm], wls: Sequence[Workload], image_size: int) -> Measured:
    """Every workload on every arm, arms in a rotating order; figures and CPU busy shares."""
    results: dict[str, dict[str, Summary]] = {}
    cpu: dict[str, dict[str, dict[str, float]]] = {}
    encodes: dict[str, dict[str, dict[str, int]]] = {}
    for wi, wl in enumerate(wls):
        results[wl.name], cpu[wl.name], encodes[wl.name] = {}, {}, {}
        order = list(arms[wi % len(arms) :]) + list(arms[: wi % len(arms)])
        for arm in order:
            others = [a for a in arms if a is not arm]
            enc0, before, routed0 = arm.encodes(), arm.cpu(), arm.routed()
            idle0, host0 = sum(sum(a.cpu().values()) for a in others), host_cpu()
            t0, client0 = time.perf_counter(), sum(os.times()[:2])
            records = await run_workload(arm.url, wl, image_size)
            wall = time.perf_counter() - t0
            client1, host1 = sum(os.times()[:2]), host_cpu()
            after, enc1, routed1 = arm.cpu(), arm.encodes(), arm.routed()
            idle1 = sum(sum(a.cpu().values()) for a in others)
            results[wl.name][arm.name] = workload_summary(wl.name, records)
            busy = {c: 100 * (after[c] - before[c]) / wall for c in after}
            busy["client"] = 100 * (client1 - client0) / wall
            busy["idle arms"] = 100 * (idle1 - idle0) / wall  # what the others cost meanwhile
            # everything else on the machine (other users of the cores), from /proc/stat
            busy["not ours"] = 100 * (host1 - host0) / wall - sum(busy.values())
            cpu[wl.name][arm.name] = busy
            encodes[wl.name][arm.name] = {c: enc1[c] - enc0[c] for c in enc1}
            if "producer" in arm.servers or arm.policy:  # the router's view of the same items
                # A router without producers counts every item "local" and
                # "producer_unavailable": of a monolithic arm, only its consumer choices.
                keys = routed1 if "producer" in arm.servers else CONSUMER_CHOICES
                moved = {k: round(routed1[k] - routed0[k]) for k in keys}
                encodes[wl.name][arm.name].update({f"router {k}": v for k, v in moved.items() if v})
            if arm.dispatch == "when-faster":  # what its router measured a producer item at
                seconds = arm.router.metric(
                    PRODUCER_ITEM_SECONDS, group="producer", modality="image"
                )
                encodes[wl.name][arm.name]["router item_ms"] = round(seconds * 1e3)
            print(f"  {wl.name} on {arm.name}: {len(records)} requests in {wall:.1f} s", flush=True)
        # stable order
        results[wl.name] = {a.name: results[wl.name][a.name] for a in arms}
        cpu[wl.name] = {a.name: cpu[wl.name][a.name] for a in arms}
        encodes[wl.name] = {a.name: encodes[wl.name][a.name] for a in arms}
    return results, cpu, encodes


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.model is None:
        from e2e.tiny_model import ensure_encoder_heavy_model

        args.model = ensure_encoder_heavy_model()
    sizes = Sizes(
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        decode_tokens=args.decode_tokens,
        mixed_heavy_images=args.mixed_heavy_images,
        mixed_gap_s=args.mixed_gap_s,
    ).scaled(args.scale)
    wls = workloads(sizes)
    work = args.work or Path(tempfile.mkdtemp(prefix="epd-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    arms = build_arms(args, args.model, work)
    t_start = time.perf_counter()
    print(f"machine: {machine()}; python {sys.version.split()[0]}", flush=True)
    print(f"model: {args.model}; images {args.image_size}px; logs: {work}")
    print("placement:", *describe_placement(arms), sep="\n")
    print(f"sizes: {asdict(sizes)}", flush=True)
    with started(arms, work, args.start_timeout, args.image_size):
        print(f"started in {time.perf_counter() - t_start:.0f} s", flush=True)
        for a in arms:
            if a.dispatch == "when-faster":
                print(f"  {a.name}: --encode-seconds image={a.encode_s:.4f}", flush=True)
        asyncio.run(warm(arms, args.image_size))
        calib = asyncio.run(calibrate(arms, args.image_size, sizes.max_tokens))
        results, cpu, encodes = asyncio.run(measure(arms, wls, args.image_size))
    print("idle calibration:", ", ".join(f"{k}={v:.3g}" for k, v in calib.items()))
    if "mono_decode_step_ms" in calib:
        placement = place(args.devices.split(","), args.producer_devices, args.mono_replicas)
        p, c = len(placement.producer), len(placement.consumer)
        if set(placement.producer) & set(placement.consumer):
            p = c = len(placement.producer)  # one shared device: no bound worth printing
        for w in wls:
            if w.name not in ("unique", "multi4"):
                continue
            b = capacity_bound(calib, len(w.requests[0].images), sizes.max_tokens, p, c)
            print(
                f"capacity bound {w.name}: encoder {b['encode_s'] * 1e3:.0f} ms + rest "
                f"{b['rest_s'] * 1e3:.0f} ms per request; pool <= {b['pool_rps']:.2f} req/s "
                f"({p} producer, {c} consumer devices), monolithic <= {b['mono_rps']:.2f}: "
                f"ratio <= {b['ratio']:.2f}"
            )
    print_tables(results, cpu)
    distinct = {w.name: len({i for r in w.requests for i in r.images}) for w in wls}
    print("images encoded per workload (vLLM's encoder runs, per server; distinct images):")
    for wl, per_arm in encodes.items():
        row = "; ".join(
            f"{arm} " + " ".join(f"{c}={n}" for c, n in comps.items())
            for arm, comps in per_arm.items()
        )
        print(f"{wl:>8}: {row}; distinct={distinct[wl]}")
    monos = [a.name for a in arms if a.name.startswith("mono")]
    pools = [a.name for a in arms if a.name.startswith("pool") and a.dispatch == "always"]
    by_pool = {p: ratios(results, p, monos) for p in pools} if monos else {}
    for arm, r in by_pool.items():
        print_ratios(arm, r)
    baselines = {
        wl: {m: best_baseline({a: per_arm[a] for a in monos}, m)[0] for m in METRICS}
        for wl, per_arm in results.items()
        if monos
    }
    if monos:
        print(f"best monolithic layout per figure: {json.dumps(baselines)}")
    # when-faster against always, per transport: the same pool, the same requests
    by_dispatch = {
        a.name: pair_ratios(results, a.name, pool_arm(t, "always"))
        for a in arms
        for t in args.transports
        if a.name == pool_arm(t, "when-faster")
    }
    for arm, r in by_dispatch.items():
        print_ratios(arm, r, arm.removesuffix("-whenFaster"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "sizes": asdict(sizes),
                    "calibration": calib,
                    "encode_seconds": {a.name: a.encode_s for a in arms if a.encode_s},
                    "results": {
                        w: {a: asdict(s) for a, s in r.items()} for w, r in results.items()
                    },
                    "cpu_busy_percent": cpu,
                    "encodes": encodes,
                    "ratios": by_pool,
                    "dispatch_ratios": by_dispatch,
                    "baselines": baselines,
                },
                indent=1,
            )
        )
    if args.plot and by_pool:
        plot(args.plot, by_pool, f"EPD pool / best monolithic layout, {args.device}, equal devices")
    elif args.plot and by_dispatch:
        title = f"EPD pool, --dispatch when-faster / always, {args.device}"
        plot(args.plot, by_dispatch, title, "when-faster/always")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    for arm, r in by_dispatch.items():
        transport = arm.removeprefix("pool-").removesuffix("-whenFaster").upper()
        print(result_line(r, f"DISPATCH_{transport}"))
    if not by_pool:
        return
    headline = f"pool-{args.headline}"
    for arm in pools:
        if arm != headline:
            print(result_line(by_pool[arm], "RESULT_" + arm.removeprefix("pool-").upper()))
    print(result_line(by_pool[headline]))


if __name__ == "__main__":
    main()
