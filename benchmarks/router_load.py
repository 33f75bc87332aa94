"""The router's own cost at 50 concurrent requests, against stub backends.

Real vLLM on this 2-core machine is too slow and too noisy to show a cost of
a millisecond (``router_overhead.py`` uses it to prove answers unchanged end
to end). Here the backends are ``benchmarks.router_stub`` processes (one
producer, one consumer) answering with vLLM-shaped bodies after a service
time the request names, and the same request stream goes, phase after phase
in rotating order, straight to the consumer stub and through two router
processes: ``--reuse-encoded-s`` (a shared-volume pool as deployed: items seen
before skip the producer) and one sending every item to the producer.

Load: ``--concurrency`` clients (default 50), each a kept-alive connection
sending its next request as soon as the previous answer ends (closed loop);
every phase keeps all of them busy until the last measured answer. Before it
starts timing, a phase opens afresh each connection idle for a second or more
(a router may close one left idle while the other paths ran, even as it is
used again). A
request's service time is ``--per-token-ms`` x its ``max_tokens`` (8-32) plus
``--per-mb-ms`` x its body's size in MB (prefill of a larger image), the same
on every path. A request's excess is its latency minus that service time;
added latency = a router's excess percentile minus the direct path's.

Scenarios: ``small`` (one 112x112 PNG, about 1.5 KB of base64: the body is
about 2 KB), ``small-stream`` (the same, streamed: SSE, one event per token)
and ``large`` (one image of ``--large-mb`` MB of base64).

Before and after in one run: ``--baseline-ref REF`` (a git commit) also runs
the router of REF, both modes, as ``reuse@base`` and ``every-item@base``
beside the current tree's routers, in the same rotation of phases (a router
and its twin stay adjacent, the twin first in every other round). REF's
contracts/, connector/, operator/ and router/ are extracted with ``git
archive`` into a temporary folder (removed at the end), and REF's router
processes import from there alone (checked before anything is measured). Every
router gets the same flags, ones old routers take too (see ``Router``).

CPUs: the routers on ``--router-cpus`` (default 0), the load generator and
the stubs on ``--load-cpus`` (default 1), pinned with taskset / sched_setaffinity.
The routers' CPU time per request is read from /proc. Every process of the run
gets ``--nice`` (default -10, root only), so other work on the machine
disturbs it less; the same for every path. With ``--profile DIR``
py-spy (on PATH or in /tmp/pyspy) samples each router during its phases of
each scenario and writes one collapsed-stack file per router and scenario.

    python benchmarks/router_load.py [--rounds 2] [--requests 40] [--profile DIR]
        [--baseline-ref REF]

Last lines: ``RESULT_EVERY_ITEM router_added_ms_p50=.. p99=.. large_p50=..``
and ``RESULT router_added_ms_p50=<small, reuse> p99=<small, reuse>
large_p50=<large, reuse>``. With ``--baseline-ref``, then the same two for
REF's router, ``RESULT_BASELINE_EVERY_ITEM ... ref=<short sha>`` and
``RESULT_BASELINE ... ref=<short sha>``, and the current router's figures
over REF's, ``RESULT_RATIO_EVERY_ITEM`` and ``RESULT_RATIO`` (after/before;
nan where REF's figure is not above zero). A ``COMPARE`` line per scenario and
mode sets both routers' added latency and CPU per request side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.stats import cpu_seconds, percentile
from e2e.media import MODEL, data_url, image
from e2e.processes import start_group, stop_group
from e2e.vllm_server import REPO, base_env, free_port
from encoderpool_contracts.router_args import env_name

# Router processes by mode, and the flags of each mode.
ROUTERS: dict[str, list[str]] = {"reuse": ["--reuse-encoded-s", "600"], "every-item": []}
ROUTED = tuple(ROUTERS)
PATHS = ("direct", *ROUTED)
# A connection unused this long is opened again before a phase (see run_phase).
IDLE_S = 1.0
# A mode's path through the baseline ref's router: "<mode>@base".
BASE = "@base"
# The folders of a tree its router imports from (the current tree's, or the baseline's).
TREE_DIRS = ("contracts", "connector", "operator", "router")


# --- a lean HTTP/1.1 client -------------------------------------------------------------


class Conn:
    """One kept-alive connection; requests are prebuilt, answers read by length or chunks."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/json\r\nContent-Length: "
        ).encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.used = 0.0  # time.monotonic() of its last request

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(
            "127.0.0.1", self.port, limit=1 << 20
        )

    async def refresh(self, idle_s: float) -> bool:
        """Open again a connection unused for ``idle_s`` or closed by the server."""
        alive = self.reader is not None and not self.reader.at_eof()
        if alive and time.monotonic() - self.used < idle_s:
            return False
        self.close()
        await self.open()
        return True

    async def post(self, body: bytes) -> tuple[int, bytes]:
        self.used = time.monotonic()
        if self.writer is None:
            await self.open()
        assert self.reader is not None
        assert self.writer is not None
        head = self.head + str(len(body)).encode() + b"\r\n\r\n"
        if len(body) < 65536:
            self.writer.write(head + body)
        else:  # two writes: no copy of a large body
            self.writer.write(head)
            self.writer.write(body)
        await self.writer.drain()
        r = self.reader
        lines = (await r.readuntil(b"\r\n\r\n")).split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length, chunked = -1, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if not chunked:
            return status, await r.readexactly(length)
        parts: list[bytes] = []
        while True:
            size = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await r.readuntil(b"\r\n")
                return status, b"".join(parts)
            parts.append((await r.readexactly(size + 2))[:-2])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


# --- requests ---------------------------------------------------------------------------


@dataclass
class Req:
    body: bytes
    service_s: float
    item: int  # which distinct image


def requests_for(scenario: str, n: int, args: argparse.Namespace, rng: random.Random) -> list[Req]:
    """``n`` requests over a few distinct images (so repeats are what reuse sees)."""
    if scenario == "large":
        raw = [rng.randbytes(int(args.large_mb * 1024 * 1024 * 3 / 4)) for _ in range(8)]
        urls = ["data:image/png;base64," + base64.b64encode(b).decode() for b in raw]
    else:
        urls = [data_url(image(3000 + i)) for i in range(16)]
    out = []
    for _ in range(n):
        item = rng.randrange(len(urls))
        url = urls[item]
        tokens = rng.randint(8, 32)
        service_ms = args.per_token_ms * tokens + args.per_mb_ms * len(url) / 1e6
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "Describe this image."},
                    ],
                }
            ],
            "temperature": 0,
            "max_tokens": tokens,
            "return_token_ids": True,
            "user": f"stub-delay-ms={service_ms:.3f}",
        }
        if scenario == "small-stream":
            body["stream"] = True
        out.append(Req(json.dumps(body).encode(), service_ms / 1e3, item))
    return out


# --- phases -----------------------------------------------------------------------------


@dataclass
class Phase:
    excess_ms: list[float] = field(default_factory=list)
    params_seen: int = 0
    answers: int = 0  # measured
    sent: int = 0  # measured and not (the router's CPU time is over all of them)
    wall_s: float = 0.0
    router_cpu_s: float = 0.0


def seen(status: int, answer: bytes) -> bool:
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {answer[:300]!r}")
    return b'"ec_params_seen": true' in answer


async def run_phase(conns: list[Conn], reqs: list[Req], per_worker: int) -> Phase:
    """Every client sends ``per_worker`` measured requests, then keeps sending (unmeasured)
    until the last client is done, so the concurrency holds for every measured one."""
    phase = Phase()
    done = asyncio.Event()
    left = len(conns)
    # A router may close connections left idle while the other paths' phases ran (its
    # timeout for a request head), even as one is used again: open every idle one again
    # before anything is timed, and give the server a moment to accept them.
    if any(await asyncio.gather(*(c.refresh(IDLE_S) for c in conns))):
        await asyncio.sleep(0.05)

    async def client(w: int, conn: Conn) -> None:
        nonlocal left
        await asyncio.sleep(w * 0.0005)  # no lock-step start
        j = 0
        while True:
            req = reqs[(w * 7919 + j) % len(reqs)]
            start = time.perf_counter()
            status, answer = await conn.post(req.body)
            elapsed = time.perf_counter() - start
            phase.sent += 1
            p = seen(status, answer)
            if j < per_worker:
                phase.excess_ms.append((elapsed - req.service_s) * 1e3)
                phase.params_seen += p
                phase.answers += 1
                if j == per_worker - 1:
                    left -= 1
                    if left == 0:
                        done.set()
            elif done.is_set():
                return
            j += 1

    start = time.perf_counter()
    await asyncio.gather(*(client(w, c) for w, c in enumerate(conns)))
    phase.wall_s = time.perf_counter() - start
    return phase


@contextlib.contextmanager
def failing_as(what: str) -> Iterator[None]:
    """Name the scenario and path of a failed request (an HTTP error, a closed connection)."""
    try:
        yield
    except (OSError, asyncio.IncompleteReadError, RuntimeError) as e:
        raise RuntimeError(f"{what}: {e!r}") from e


def rotation(paths: Sequence[str], rnd: int) -> list[str]:
    """Round ``rnd``'s order of phases: the paths rotated by one place per round. A router and
    its baseline twin move as one, the twin first in odd rounds; without twins this is the
    plain rotation."""
    groups = [
        [p, *([p + BASE] if p + BASE in paths else [])] for p in paths if not p.endswith(BASE)
    ]
    k = rnd % len(groups)
    order: list[str] = []
    for group in groups[k:] + groups[:k]:
        order += reversed(group) if rnd % 2 else group
    return order


# --- processes --------------------------------------------------------------------------


@dataclass
class Stub:
    role: str
    log: Path
    cpus: str
    producer_ms: float = 0.0
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = ["taskset", "-c", self.cpus, sys.executable, "-m", "benchmarks.router_stub"]
        argv += ["--role", self.role, "--port", str(self.port)]
        argv += ["--producer-ms", str(self.producer_ms)]
        self.proc = start_group(argv, {**base_env(), "PYTHONPATH": str(REPO)}, self.log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"stub {self.role} did not start; log {self.log}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)


# See Router.start.
BENCH_CLIENT_BODY_MEMORY = 512 << 20


@dataclass
class Router:
    """``python -m encoderpool_router`` importing from ``tree`` (the current one, or a
    baseline ref's extracted copy). Its flags are the ones routers have taken since this
    benchmark was written (--host --port --metrics-port --producers --consumers
    --log-level --reuse-encoded-s), so a baseline's router accepts them too. A newer
    router's own settings go by environment, which an older router ignores: the probe
    port (8081 by default, which would collide between routers) is a free one."""

    args: list[str]
    log: Path
    cpus: str
    tree: Path = REPO
    port: int = 0  # taken when it starts, so no other process takes it meanwhile
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        paths = [str(self.tree / d) for d in TREE_DIRS if (self.tree / d).is_dir()]
        return {**base_env(), "PYTHONPATH": os.pathsep.join(paths)}

    def start(self) -> Router:
        self.port = free_port()
        argv = ["taskset", "-c", self.cpus, sys.executable, "-m", "encoderpool_router"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--metrics-port", str(free_port()), *self.args]
        env = {**self.env(), env_name("probe_port"): str(free_port())}
        # The load generator's clients all come from 127.0.0.1: one client to the router,
        # whose default share of body memory (a quarter of the budget) holds about 40
        # bodies of 2 MB. Here the share is the whole budget, the rest as deployed.
        env[env_name("body_memory_per_client_bytes")] = str(BENCH_CLIENT_BODY_MEMORY)
        self.proc = start_group(argv, env, self.log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"router of {self.tree} exited {self.proc.returncode}: {text}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"router of {self.tree} did not start; log {self.log}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)


def extract(ref: str, into: Path) -> str:
    """REF's router and the packages it imports, from ``git archive`` into ``into``; returns
    REF's short sha."""
    git = ["git", "-C", str(REPO)]
    found = subprocess.run(
        [*git, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if found.returncode != 0:
        raise SystemExit(f"--baseline-ref {ref}: not a commit of {REPO}")
    sha = found.stdout.strip()
    listed = subprocess.run(
        [*git, "ls-tree", "--name-only", sha, "--", *TREE_DIRS],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    dirs = listed.stdout.split()
    if "router" not in dirs:
        raise SystemExit(f"--baseline-ref {ref}: {sha[:12]} has no router/")
    archive = subprocess.run(
        [*git, "archive", "--format=tar", sha, "--", *dirs], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    short = subprocess.run(
        [*git, "rev-parse", "--short", sha], capture_output=True, text=True, check=True
    ).stdout.strip()
    return short


def check_imports(router: Router) -> None:
    """Fail before anything is measured when ``router`` would import our packages from
    outside its tree (run as it runs: same environment, same working directory)."""
    code = (
        "import encoderpool_contracts as c, encoderpool_router as r; print(c.__file__, r.__file__)"
    )
    imported = subprocess.run(
        [sys.executable, "-c", code],
        env=router.env(), cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    tree = router.tree.resolve()
    outside = [f for f in imported.stdout.split() if not Path(f).resolve().is_relative_to(tree)]
    if outside:
        raise SystemExit(f"the router of {tree} would import {' '.join(outside)}")


def pyspy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    local = Path("/tmp/pyspy/bin/py-spy")
    return str(local) if local.exists() else None


# --- main -------------------------------------------------------------------------------


async def scenario_run(
    scenario: str,
    args: argparse.Namespace,
    targets: dict[str, int],
    router_pids: dict[str, int],
    profile_dir: Path | None,
) -> dict[str, Phase]:
    rng = random.Random(f"router-load-{scenario}")
    reqs = requests_for(scenario, 48 if scenario == "large" else 499, args, rng)
    conns = {path: [Conn(port) for _ in range(args.concurrency)] for path, port in targets.items()}
    # Every distinct body once through each router (reuse: the producer has seen each item),
    # then a short unmeasured phase per path (connections opened, pools filled).
    distinct = list({r.item: r for r in reqs}.values())
    for path in targets:
        if path != "direct":
            with failing_as(f"{scenario}, path {path}"):
                for r in distinct:
                    seen(*await conns[path][0].post(r.body))
    for path in targets:
        with failing_as(f"{scenario}, path {path}"):
            await run_phase(conns[path], reqs, 3)
    profilers: list[subprocess.Popen[bytes]] = []
    spy = pyspy()
    if profile_dir is not None and spy is not None:
        for path, pid in router_pids.items():
            out = profile_dir / f"{scenario}-{path}.txt"
            cmd = [spy, "record", "--pid", str(pid), "--rate", "500", "--format", "raw"]
            cmd += ["--output", str(out), "--nonblocking"]
            log = profile_dir / f"{scenario}-{path}.log"
            profilers.append(start_group(cmd, dict(os.environ), log))
        time.sleep(1.0)
    results = {path: Phase() for path in targets}
    try:
        for rnd in range(args.rounds):
            for path in rotation(tuple(targets), rnd):
                rpid = router_pids.get(path)
                cpu0 = cpu_seconds(rpid) if rpid is not None else 0.0
                with failing_as(f"{scenario}, path {path}"):
                    ph = await run_phase(conns[path], reqs, args.requests)
                ph.router_cpu_s = cpu_seconds(rpid) - cpu0 if rpid is not None else 0.0
                acc = results[path]
                acc.excess_ms += ph.excess_ms
                acc.params_seen += ph.params_seen
                acc.answers += ph.answers
                acc.sent += ph.sent
                acc.wall_s += ph.wall_s
                acc.router_cpu_s += ph.router_cpu_s
    finally:
        for p in profilers:
            p.send_signal(2)  # SIGINT: py-spy writes its output and exits
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                stop_group(p, kill=True)
        for cs in conns.values():
            for c in cs:
                c.close()
    return results


def report(scenario: str, results: dict[str, Phase], args: argparse.Namespace) -> dict[str, Any]:
    direct = results["direct"].excess_ms
    print(f"\n[{scenario}] concurrency={args.concurrency} requests per path={len(direct)}")
    out: dict[str, Any] = {}
    width = max(12, *(len(path) for path in results))
    for path, ph in results.items():
        xs = ph.excess_ms
        rate = ph.sent / ph.wall_s if ph.wall_s else 0.0
        cpu = (
            f" router CPU {ph.router_cpu_s / ph.sent * 1e3:.3f} ms/request"
            if ph.router_cpu_s
            else ""
        )
        print(
            f"{path:>{width}} excess ms: p50={percentile(xs, 50):7.3f} "
            f"p90={percentile(xs, 90):7.3f} p99={percentile(xs, 99):7.3f} "
            f"mean={statistics.fmean(xs):7.3f} "
            f"({rate:.0f} req/s, params seen {ph.params_seen}/{ph.answers}){cpu}"
        )
    for path, ph in results.items():
        if path == "direct":
            continue
        added = {q: percentile(ph.excess_ms, q) - percentile(direct, q) for q in (50, 90, 99)}
        out[path] = {**added, "cpu_ms": ph.router_cpu_s / ph.sent * 1e3 if ph.sent else 0.0}
        print(
            f"{'added ' + path:>{width + 6}} ms: p50={added[50]:7.3f} p90={added[90]:7.3f} "
            f"p99={added[99]:7.3f}"
        )
    # What each router must have done: reuse sends nothing (every item seen before),
    # every-item sends params with every request; direct never has any.
    assert results["direct"].params_seen == 0
    for path, ph in results.items():
        mode = path.removesuffix(BASE)
        if mode == "reuse":
            assert ph.params_seen == 0, f"{path}: an item went to a producer again"
        elif mode == "every-item":
            assert ph.params_seen == ph.answers, f"{path}: an item skipped the producer"
    return out


def figures(summary: dict[str, dict[str, Any]], path: str) -> tuple[float, float, float]:
    """A path's added ms: small p50, small p99, large p50 (nan for a scenario not run)."""
    nan = float("nan")
    small = summary.get("small", {}).get(path, {50: nan, 99: nan})
    large = summary.get("large", {}).get(path, {50: nan})
    return small[50], small[99], large[50]


def ratio(after: float, before: float) -> float:
    """after / before; nan where before is not above zero (an added latency lost in noise)."""
    return after / before if before > 0 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--requests", type=int, default=40, help="measured per client per phase")
    ap.add_argument("--rounds", type=int, default=2, help="phases per path per scenario")
    ap.add_argument("--per-token-ms", type=float, default=5.0)
    ap.add_argument("--per-mb-ms", type=float, default=100.0)
    ap.add_argument("--producer-ms", type=float, default=0.0)
    ap.add_argument("--large-mb", type=float, default=2.0)
    ap.add_argument("--large-requests", type=int, default=12, help="--requests for large")
    ap.add_argument("--scenarios", default="small,small-stream,large")
    ap.add_argument("--router-cpus", default="0")
    ap.add_argument("--load-cpus", default="1")
    ap.add_argument("--profile", type=Path, default=None, help="py-spy output directory")
    ap.add_argument(
        "--nice", type=int, default=-10, help="priority of every process of the run (0: leave)"
    )
    ap.add_argument(
        "--baseline-ref",
        default=None,
        metavar="REF",
        help="a git commit whose router runs beside the current tree's, in the same phases",
    )
    args = ap.parse_args()

    os.sched_setaffinity(0, {int(c) for c in args.load_cpus.split(",")})
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    work = Path(tempfile.mkdtemp(prefix="router-load-"))
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    producer = Stub("producer", work / "producer.log", args.load_cpus, args.producer_ms)
    consumer = Stub("consumer", work / "consumer.log", args.load_cpus)
    routers: dict[str, Router] = {}
    summary: dict[str, dict[str, Any]] = {}
    base_tree = Path(tempfile.mkdtemp(prefix="router-load-base-")) if args.baseline_ref else None
    short = ""
    try:
        backends = ["--producers", producer.url, "--consumers", consumer.url]
        backends += ["--log-level", "WARNING"]
        if base_tree is not None:
            short = extract(args.baseline_ref, base_tree)
            print(f"baseline: {args.baseline_ref} ({short}), extracted to {base_tree}", flush=True)
        for mode, flags in ROUTERS.items():
            log = work / f"router-{mode}.log"
            routers[mode] = Router([*backends, *flags], log, args.router_cpus)
            if base_tree is not None:
                log = work / f"router-{mode}{BASE}.log"
                routers[mode + BASE] = Router([*backends, *flags], log, args.router_cpus, base_tree)
        for router in {r.tree: r for r in routers.values()}.values():  # one per tree
            check_imports(router)
        producer.start()
        consumer.start()
        for router in routers.values():
            router.start()
        targets = {"direct": consumer.port, **{m: r.port for m, r in routers.items()}}
        pids = {m: r.proc.pid for m, r in routers.items() if r.proc is not None}
        if args.nice:  # ahead of whatever else the machine runs, all paths alike
            for proc in (producer.proc, consumer.proc, *(r.proc for r in routers.values())):
                if proc is not None:
                    os.setpriority(os.PRIO_PROCESS, proc.pid, args.nice)
        for scenario in args.scenarios.split(","):
            a = argparse.Namespace(**vars(args))
            if scenario == "large":
                a.requests = args.large_requests
            results = asyncio.run(scenario_run(scenario, a, targets, pids, args.profile))
            summary[scenario] = report(scenario, results, a)
    finally:
        for r in routers.values():
            r.stop()
        producer.stop()
        consumer.stop()
        if base_tree is not None:
            shutil.rmtree(base_tree, ignore_errors=True)

    print(
        f"\nrouters on CPU {args.router_cpus}, load generator and stubs on CPU {args.load_cpus}; "
        f"service time {args.per_token_ms} ms/token + {args.per_mb_ms} ms/MB"
    )
    if short:
        for scenario, by_path in summary.items():
            for mode in ROUTED:
                a, b = by_path[mode], by_path[mode + BASE]
                print(
                    f"COMPARE {scenario} {mode}: after vs before ({short}) added p50 "
                    f"{a[50]:.2f} vs {b[50]:.2f} ms, p99 {a[99]:.2f} vs {b[99]:.2f} ms; router "
                    f"CPU {a['cpu_ms']:.3f} vs {b['cpu_ms']:.3f} ms/request "
                    f"(ratio {ratio(a['cpu_ms'], b['cpu_ms']):.2f})"
                )
    lines = [("RESULT_EVERY_ITEM", "every-item"), ("RESULT", "reuse")]
    for label, mode in lines:
        p50, p99, large = figures(summary, mode)
        print(f"{label} router_added_ms_p50={p50:.2f} p99={p99:.2f} large_p50={large:.2f}")
    if short:
        for label, mode in lines:
            p50, p99, large = figures(summary, mode + BASE)
            print(
                f"{label.replace('RESULT', 'RESULT_BASELINE')} router_added_ms_p50={p50:.2f} "
                f"p99={p99:.2f} large_p50={large:.2f} ref={short}"
            )
        for label, mode in lines:
            after, before = figures(summary, mode), figures(summary, mode + BASE)
            p50, p99, large = (ratio(x, y) for x, y in zip(after, before, strict=True))
            print(
                f"{label.replace('RESULT', 'RESULT_RATIO')} router_added_ms_p50={p50:.2f} "
                f"p99={p99:.2f} large_p50={large:.2f} ref={short}"
            )


if __name__ == "__main__":
    main()
