"""One hostile client against the router as the operator renders it, while another
client and the kubelet's probes need it.

The router runs as a process with the Deployment's own arguments, environment and
memory limit (a cgroup, ``e2e.cgroup``), its Services swapped for a stub consumer
(``benchmarks.router_stub``: vLLM-shaped answers after a delay the request names).
Phase after phase, one client on 127.0.0.1 mounts one attack:

- ``connections``: as many connections as it may open (4,200 tries, past any cap the
  router has had), half silent, half stopped in the middle of a request head,
  reopened as the router closes or refuses them;
- ``heads``: a thousand tries at connections each holding the largest unfinished
  head allowed (``max_headers`` fields of 8 KiB);
- ``unfinished-bodies``: large bodies declared and never finished;
- ``complete-bodies``: large bodies sent whole to a consumer that takes 20 s;
- ``large-answers``: non-streamed answers of tens of MiB, read slowly;

and a last phase, ``global``, has many addresses fill the router's whole connection
cap with worst-case heads (the bound the memory plan is derived for). Throughout, a
second client on 127.0.0.2 sends ordinary requests and a prober calls the probe port
as the kubelet would (5 s timeout). Recorded per phase: the router's peak RSS, the
second client's statuses, the probes' failures, what the attacker was answered.

    python -m e2e.front_door [--router-tree DIR] [--no-limit]

``--router-tree``: run another tree's router (e.g. ``git archive <commit>`` unpacked),
for a before/after comparison; a router without a probe port is probed on its API port.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e.cgroup import memory_limited, rss_bytes
from e2e.kind.attacker import worst_head
from e2e.processes import exit_on_sigterm, start_group, stop_group
from e2e.vllm_server import REPO, base_env, free_port
from encoderpool_contracts.router_args import MEMORY_LIMIT_ENV, PROBE_PORT_ENV
from encoderpool_operator.api import EncoderPool, parse_quantity
from encoderpool_operator.render.router import router_objects
from encoderpool_router.config import RouterSettings

MIB = 1 << 20
HOSTILE = "127.0.0.1"
GOOD = "127.0.0.2"
PHASE_S = 14.0  # past the router's 10 s head deadline, so it closes what it must
BODY_BYTES = 48 * MIB
ANSWER_TOKENS = 400_000  # about 6 MiB of JSON from the stub: 24 x the router's buffer
SLOW_CONSUMER_MS = 20_000
CONNECTIONS = 4200  # past the 4,096 the router's one cap used to be
HEADS = 1000
PHASES = (
    "connections",
    "heads",
    "unfinished-bodies",
    "complete-bodies",
    "large-answers",
    "global",
)


# --- the router as rendered ----------------------------------------------------------


@dataclass
class Rendered:
    """What the operator renders for a pool's router container."""

    args: list[str]
    env: dict[str, str]
    memory_limit: int
    probe_paths: dict[str, str]  # probe -> path
    max_headers: int = RouterSettings.model_fields["max_headers"].default
    per_address: int = RouterSettings.model_fields["max_connections_per_address"].default


def rendered_router() -> Rendered:
    """The router container of the shared-volume example pool, as rendered."""
    obj = yaml.safe_load((REPO / "examples" / "pool-shared-volume.yaml").read_text())
    obj["metadata"] = {"name": "pool", "namespace": "ml", "uid": "u-1", "generation": 1}
    pool = EncoderPool.from_object(obj)
    (deployment,) = [o for o in router_objects(pool, "router:test") if o["kind"] == "Deployment"]
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    probes = {
        p: c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    return Rendered(
        args=list(c["args"]),
        env=env,
        memory_limit=int(parse_quantity(c["resources"]["limits"]["memory"])),
        probe_paths=probes,
    )


def local_args(args: list[str], consumer: str, port: int, metrics_port: int) -> list[str]:
    """The rendered flags with the Services swapped for a static consumer (no producers:
    the consumer encodes), on loopback ports."""
    out: list[str] = []
    skip = {"--producer-service", "--producer-services-by-modality", "--namespace"}
    swap = {
        "--consumer-service": consumer,
        "--host": "127.0.0.1",
        "--port": str(port),
        "--metrics-port": str(metrics_port),
    }
    i = 0
    while i < len(args):
        name, value = args[i], args[i + 1]
        i += 2
        if name in skip:
            continue
        if name == "--consumer-service":
            out += ["--consumers", swap[name]]
        else:
            out += [name, swap.get(name, value)]
    return out


# --- clients -------------------------------------------------------------------------


def chat(text: str, user: str = "stub-delay-ms=0", max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": "stub",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "user": user,
    }


def image_body(size: int, user: str) -> bytes:
    """A chat request with one inline image of about ``size`` bytes of base64."""
    data = base64.b64encode(os.urandom(size * 3 // 4)).decode()
    body = chat("what is this?", user)
    body["messages"][0]["content"] = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}},
    ]
    return json.dumps(body).encode()


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%s\r\n" % (path.encode(), len(body), extra)
    ) + body


async def _status(reader: asyncio.StreamReader, timeout: float) -> int:
    line = await asyncio.wait_for(reader.readline(), timeout)
    parts = line.split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


async def _read_answer(reader: asyncio.StreamReader, timeout: float) -> int:
    """One HTTP answer's status; its headers and Content-Length body read."""
    status = await _status(reader, timeout)
    length = 0
    while True:
        line = await asyncio.wait_for(reader.readline(), timeout)
        if line in (b"\r\n", b""):
            break
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    if length:
        await asyncio.wait_for(reader.readexactly(length), timeout)
    return status


@dataclass
class Tally:
    statuses: Counter[str] = field(default_factory=Counter)
    # The longest run of failures in a row, per probe path (the kubelet acts on a run
    # of failureThreshold, 3 or more in what the operator renders).
    streaks: dict[str, int] = field(default_factory=dict)
    _run: dict[str, int] = field(default_factory=dict)

    def note(self, what: str) -> None:
        self.statuses[what] += 1

    def probe(self, path: str, ok: bool, what: str) -> None:
        self.note(f"{path}:{what}")
        self._run[path] = 0 if ok else self._run.get(path, 0) + 1
        self.streaks[path] = max(self.streaks.get(path, 0), self._run[path])


async def good_client(port: int, stop: asyncio.Event, tally: Tally) -> None:
    """Ordinary requests from 127.0.0.2, one after another, on a kept-alive connection
    (a new one after any failure)."""
    body = json.dumps(chat("hello there")).encode()
    while not stop.is_set():
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(GOOD, 0))
        except OSError as e:
            tally.note(f"connect:{type(e).__name__}")
            await asyncio.sleep(0.2)
            continue
        try:
            while not stop.is_set():
                w.write(post("/v1/chat/completions", body))
                status = await _read_answer(r, 30)
                tally.note(str(status))
                if status != 200:
                    break
                await asyncio.sleep(0.1)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            tally.note(f"error:{type(e).__name__}")
        finally:
            w.close()


async def prober(port: int, paths: list[str], stop: asyncio.Event, tally: Tally) -> None:
    """The kubelet: each probe path every second, a new connection each, 5 s timeout."""
    while not stop.is_set():
        for path in paths:
            try:
                r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
                w.write(
                    b"GET %s HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n" % path.encode()
                )
                status = await _status(r, 5)
                tally.probe(path, status == 200, str(status))
                w.close()
            except (OSError, TimeoutError) as e:
                tally.probe(path, False, type(e).__name__)
        await asyncio.sleep(1.0)


async def _connection(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _answered(answer: asyncio.Future[Any], stop: asyncio.Event) -> bool:
    """Wait for ``answer`` or the phase's end, whichever comes first; an answer not come
    by then is cancelled. Whether it came."""
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({answer, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not answer.done():
        answer.cancel()
        return False
    return True


async def _hold(port: int, source: str, opening: bytes, stop: asyncio.Event, tally: Tally) -> None:
    """One connection that sends ``opening`` and nothing more, reopened when closed."""
    while not stop.is_set():
        try:
            r, w = await _connection(port, source)
        except OSError as e:
            tally.note(f"connect:{type(e).__name__}")
            await asyncio.sleep(0.5)
            continue
        try:
            # A connection over a cap is answered 503 and closed on accept, before it sends
            # a byte: look for that answer first, or writing a large head into the closed
            # socket can fail (EPIPE) before the 503 is read.
            try:
                answer: bytes | None = await asyncio.wait_for(r.read(256), 0.05)
            except TimeoutError:
                answer = None
            if answer is None:
                for k in range(0, len(opening), 64 << 10):
                    w.write(opening[k : k + (64 << 10)])
                    await asyncio.wait_for(w.drain(), 10)
                done = asyncio.ensure_future(r.read(256))
                if await _answered(done, stop):
                    answer = done.result()
            if answer is not None:
                tally.note("closed" if not answer else answer.split(b"\r\n")[0].decode())
        except (OSError, TimeoutError) as e:
            tally.note(f"error:{type(e).__name__}")
        finally:
            w.close()
        await asyncio.sleep(1.0)  # then again: a answer or closed slot is tried once a second


async def _bodies(port: int, body: bytes, finish: bool, stop: asyncio.Event, tally: Tally) -> None:
    """One connection after another sending ``body`` (all of it, or all but its last
    byte), recording the answer."""
    while not stop.is_set():
        try:
            r, w = await _connection(port, HOSTILE)
        except OSError as e:
            tally.note(f"connect:{type(e).__name__}")
            await asyncio.sleep(0.5)
            continue
        try:
            data = memoryview(post("/v1/chat/completions", body))
            end = len(data) if finish else len(data) - 1
            answer = asyncio.ensure_future(_status(r, 120))
            for k in range(0, end, MIB):
                if answer.done():
                    break
                w.write(data[k : min(end, k + MIB)])
                await asyncio.wait_for(w.drain(), 30)
            if await _answered(answer, stop):
                tally.note(str(answer.result()) if not answer.exception() else "closed")
        except (OSError, TimeoutError) as e:
            tally.note(f"error:{type(e).__name__}")
        finally:
            w.close()
        await asyncio.sleep(0.2)


async def _large_answer(port: int, stop: asyncio.Event, tally: Tally) -> None:
    """A request whose non-streamed answer is tens of MiB, read 64 KiB at a time."""
    body = json.dumps(chat("tell me everything", max_tokens=ANSWER_TOKENS)).encode()
    while not stop.is_set():
        status, got, whole = 0, 0, False
        try:
            r, w = await _connection(port, HOSTILE)
            w.write(post("/v1/chat/completions", body))
            status = await _status(r, 120)
            while True:
                chunk = await asyncio.wait_for(r.read(64 << 10), 120)
                if not chunk:
                    whole = True
                    break
                got += len(chunk)
                await asyncio.sleep(0.01)
            w.close()
        except (OSError, TimeoutError) as e:
            tally.note(f"error:{type(e).__name__}")
        finally:  # noted even when the phase ends mid-answer
            tally.note(f"{status}:{'whole' if whole and got > ANSWER_TOKENS else 'partial'}")


def attack(
    phase: str, port: int, r: Rendered, stop: asyncio.Event, tally: Tally
) -> list[asyncio.Task[None]]:
    """The attacker's tasks for ``phase``."""
    if phase == "connections":
        half = b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nX-Half"
        openings = [b"" if i % 2 else half for i in range(CONNECTIONS)]
        coros = [_hold(port, HOSTILE, o, stop, tally) for o in openings]
    elif phase == "heads":
        head = worst_head(r.max_headers)
        coros = [_hold(port, HOSTILE, head, stop, tally) for _ in range(HEADS)]
    elif phase in ("unfinished-bodies", "complete-bodies"):
        finish = phase == "complete-bodies"
        body = image_body(BODY_BYTES, f"stub-delay-ms={SLOW_CONSUMER_MS}")
        coros = [_bodies(port, body, finish, stop, tally) for _ in range(12)]
    elif phase == "large-answers":
        coros = [_large_answer(port, stop, tally) for _ in range(4)]
    elif phase == "global":
        head = worst_head(r.max_headers)
        sources = [f"127.0.1.{i}" for i in range(1, 9)]  # 8 x 128: past any derived cap
        coros = [_hold(port, s, head, stop, tally) for s in sources for _ in range(r.per_address)]
    else:
        raise ValueError(f"unknown phase {phase!r}: one of {', '.join(PHASES)}")
    return [asyncio.ensure_future(c) for c in coros]


# --- a run ---------------------------------------------------------------------------


@dataclass
class PhaseResult:
    phase: str
    rss_peak: int
    good: Counter[str]
    probes: Counter[str]
    attacker: Counter[str]
    alive: bool
    probe_streak: int = 0  # the longest run of failed probes of one path

    def line(self) -> str:
        return (
            f"{self.phase:18} rss_peak={self.rss_peak / MIB:7.1f} MiB  alive={self.alive}  "
            f"good={dict(self.good)}  probes={dict(self.probes)}  "
            f"attacker={dict(self.attacker.most_common(4))}"
        )


class RssWatch:
    """The peak RSS of a process, sampled every 20 ms on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes(self.pid))

    @contextlib.contextmanager
    def watching(self) -> Iterator[RssWatch]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()

    def reset(self) -> int:
        peak, self.peak = self.peak, rss_bytes(self.pid)
        return peak


@dataclass
class Run:
    limit: int
    how: str
    idle_rss: int
    results: list[PhaseResult]
    log: str


def _wait_listening(port: int, proc: Any, timeout: float = 60) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


def run(
    workdir: Path,
    phases: tuple[str, ...] = PHASES,
    router_tree: Path | None = None,
    limit: bool = True,
    max_headers: int | None = None,
) -> Run:
    """Start the stub consumer and the router as rendered, run each phase; the results."""
    r = rendered_router()
    if max_headers is not None:
        r.max_headers = max_headers
    consumer_port, port, metrics_port, probe_port = (free_port() for _ in range(4))
    stub = start_group(
        [sys.executable, "-m", "benchmarks.router_stub", "--role", "consumer",
         "--port", str(consumer_port)],
        base_env(), workdir / "stub.log",
    )  # fmt: skip
    env = {**base_env(), **r.env, PROBE_PORT_ENV: str(probe_port)}
    env[MEMORY_LIMIT_ENV] = str(r.memory_limit)  # the downward API's value
    if router_tree is not None:
        paths = ("contracts", "operator", "connector", "router", "")
        env["PYTHONPATH"] = ":".join(str(router_tree / p) for p in paths)
    argv = [sys.executable, "-m", "encoderpool_router"]
    argv += local_args(r.args, f"http://127.0.0.1:{consumer_port}", port, metrics_port)
    router = start_group(argv, env, workdir / "router.log")
    try:
        _wait_listening(consumer_port, stub)
        _wait_listening(port, router)
        has_probe_port = True
        try:
            _wait_listening(probe_port, router, timeout=5)
        except TimeoutError:
            has_probe_port = False  # an older router: its probes are on the API port
        with contextlib.ExitStack() as stack:
            how = "none"
            if limit:
                how = stack.enter_context(memory_limited(router.pid, r.memory_limit, "router"))
            watch = stack.enter_context(RssWatch(router.pid).watching())
            time.sleep(1.0)
            idle = rss_bytes(router.pid)
            results = asyncio.run(
                _phases(phases, port, probe_port if has_probe_port else port, r, watch, router)
            )
        return Run(r.memory_limit, how, idle, results, (workdir / "router.log").read_text())
    finally:
        stop_group(router, 20)
        stop_group(stub, 10)


async def _phases(
    phases: tuple[str, ...], port: int, probe_port: int, r: Rendered, watch: RssWatch, proc: Any
) -> list[PhaseResult]:
    out = []
    paths = sorted(set(r.probe_paths.values()))
    for phase in phases:
        stop = asyncio.Event()
        good, probes, attacker = Tally(), Tally(), Tally()
        watch.reset()
        tasks = attack(phase, port, r, stop, attacker)
        await asyncio.sleep(1.0)  # the attack mounted first
        helpers = [
            asyncio.ensure_future(good_client(port, stop, good)),
            asyncio.ensure_future(prober(probe_port, paths, stop, probes)),
        ]
        await asyncio.sleep(PHASE_S)
        stop.set()
        for t in (*tasks, *helpers):
            t.cancel()
        await asyncio.gather(*tasks, *helpers, return_exceptions=True)
        await asyncio.sleep(1.0)  # what the attack held is let go before the next phase
        out.append(
            PhaseResult(
                phase, watch.reset(), good.statuses, probes.statuses, attacker.statuses,
                proc.poll() is None, max(probes.streaks.values(), default=0),
            )
        )  # fmt: skip
        if proc.poll() is not None:
            break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router-tree", type=Path, help="another tree's router (before/after)")
    ap.add_argument("--no-limit", action="store_true", help="no memory limit: measure only")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument(
        "--max-headers",
        type=int,
        help="header fields the router allows (its default: 32; "
        "aiohttp's, in routers before the limit: 128)",
    )
    a = ap.parse_args()
    exit_on_sigterm()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="front-door-") as tmp:
        result = run(
            Path(tmp), tuple(a.phases.split(",")), a.router_tree, not a.no_limit, a.max_headers
        )
    limit, idle = result.limit / MIB, result.idle_rss / MIB
    print(f"limit {limit:.0f} MiB ({result.how}); idle rss {idle:.1f} MiB")
    for res in result.results:
        print(res.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
