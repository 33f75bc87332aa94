"""NIXL agents of the RDMA transport: the producer's (registered memory + release notices)
and the consumer's puller thread (metadata fetches, READs, verification, timeouts).

A NIXL agent is not thread-safe, so the consumer's agent belongs to one thread
(the puller) and the engine loop only posts jobs and polls futures: it never
waits on the network. Side-channel fetches run on a tiny pool beside it, so a
producer that does not answer delays only the items that need it.
"""

from __future__ import annotations

import atexit
import base64
import logging
import os
import queue
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from encoderpool_connector.rdma.auth import OncePerPeer
from encoderpool_connector.rdma.buffer import SharedRegion
from encoderpool_connector.rdma.channel import (
    Coordinates,
    PeerInfo,
    WireError,
    encode_release,
    fetch_peer,
    parse_release,
)
from encoderpool_contracts.integrity import AuthError, ChannelKey, checksum

logger = logging.getLogger("vllm.ext." + __name__)

DRAM = "DRAM"
POLL_S = 0.0002  # consumer: between checks of in-flight READs
IDLE_S = 0.05  # consumer: nothing in flight
BUSY_PROGRESS_S = 0.001  # producer: READs arrived within ACTIVE_WINDOW_S
IDLE_PROGRESS_S = 0.005
ACTIVE_WINDOW_S = 2.0
NEGATIVE_CACHE_S = 5.0


def agent_name(role: str) -> str:
    """Unique per process start, so a restarted producer never looks like its predecessor."""
    return f"ep-{role}-{os.getpid()}-{secrets.token_hex(6)}"


def _make_agent(name: str, backends: tuple[str, ...]) -> Any:
    """An agent without NIXL's progress thread: nixl 1.5.1's Python config pins its delay to
    0, so it spins a whole core even when idle (measured: 3.0 CPU-s per 3 s), stealing the
    encoder's CPU. Our own threads drive progress instead, and sleep when idle."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=list(backends)))


class ProducerAgent:
    """The producer's agent: registers the region and turns READ notices into releases.

    After set-up the agent belongs to one thread, which drives UCX progress (over TCP a READ
    needs the target's progress; over verbs it does not) and collects notifications: every
    millisecond while READs arrive, every ``IDLE_PROGRESS_S`` otherwise.
    """

    def __init__(
        self, region: SharedRegion, backends: tuple[str, ...], *, key: ChannelKey | None
    ) -> None:
        self.name = agent_name("p")
        self.region = region
        self._key = key
        self._log = OncePerPeer("a release notice")
        self.unauthenticated = 0
        self._agent = _make_agent(self.name, backends)
        self._reg = self._agent.get_reg_descs([(region.address, region.size, 0, "")], DRAM)
        self._agent.register_memory(self._reg, backends=list(backends))
        self.metadata: bytes = self._agent.get_agent_metadata()
        self.bad_notices = 0
        self._notices: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, name="ep-nixl-progress", daemon=True)
        self._thread.start()

    def side_channel_reply(self, fingerprint: str) -> dict[str, Any]:
        return {
            "agent": self.name,
            "metadata": base64.b64encode(self.metadata).decode(),
            "base": self.region.address,
            "length": self.region.size,
            "fingerprint": fingerprint,
        }

    def _progress(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            try:
                notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
            except Exception as e:  # a backend hiccup must not end progress
                logger.warning("encoderpool: reading NIXL notifications failed: %r", e)
                notifs = {}
            for sender, msgs in notifs.items():
                last = time.monotonic()
                for raw in msgs:
                    try:
                        self._notices.put(parse_release(bytes(raw), self._key))
                    except AuthError as e:
                        self.unauthenticated += 1
                        self._log.warn(str(sender), str(e))
                    except WireError as e:
                        self.bad_notices += 1
                        logger.warning("encoderpool: ignoring a malformed release notice: %s", e)
            busy = time.monotonic() - last < ACTIVE_WINDOW_S
            self._stop.wait(BUSY_PROGRESS_S if busy else IDLE_PROGRESS_S)

    def releases(self) -> list[tuple[int, int]]:
        """(slot, generation) of every READ completed since the last call."""
        out: list[tuple[int, int]] = []
        while True:
            try:
                out.append(self._notices.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as e:
            logger.debug("encoderpool: deregistering the producer region: %r", e)


# ---- consumer ----


@dataclass(frozen=True)
class PullResult:
    ok: bool
    reason: str = ""
    seconds: float = 0.0
    slot_free: bool = True
    """False: a READ may still land in the slot; keep it until ``released()`` names it."""
    kind: str = "ok"  # ok | bad_peer | unreachable | unauthenticated | timeout | failed | corrupt


@dataclass
class _Job:
    coords: Coordinates
    local_offset: int
    deadline: float
    future: Future[PullResult]
    started: float = field(default_factory=time.monotonic)
    handle: Any = None
    peer: tuple[str, int] | None = None


@dataclass
class _Peer:
    info: PeerInfo
    name: str
    fetched: float
    stale: bool = False


class Puller:
    """The consumer's agent and the thread that owns it."""

    def __init__(
        self,
        region: SharedRegion,
        backends: tuple[str, ...],
        *,
        fingerprint: str,
        metadata_timeout: float,
        key: ChannelKey | None,
    ) -> None:
        self.name = agent_name("c")
        self.key = key
        self._log = OncePerPeer("a side-channel reply")
        self.region = region
        self.fingerprint = fingerprint
        self.metadata_timeout = metadata_timeout
        self._backends = list(backends)
        self._agent = _make_agent(self.name, backends)
        self._reg = self._agent.get_reg_descs([(region.address, region.size, 0, "")], DRAM)
        self._agent.register_memory(self._reg, backends=self._backends)
        self._inbox: queue.Queue[_Job | None] = queue.Queue()
        self._released: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._fetcher = ThreadPoolExecutor(2, thread_name_prefix="ep-side-fetch")
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._fetching: dict[tuple[str, int], Future[PeerInfo]] = {}
        self._fetch_started: dict[tuple[str, int], float] = {}
        self._failed_peers: dict[tuple[str, int], tuple[float, str]] = {}
        self._waiting: list[_Job] = []
        self._inflight: list[_Job] = []
        self._zombies: list[tuple[Any, int]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ep-puller", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # vLLM skips shutdown() on some exit paths

    # ---- engine-loop side ----

    def submit(self, coords: Coordinates, local_offset: int, timeout: float) -> Future[PullResult]:
        fut: Future[PullResult] = Future()
        self._inbox.put(_Job(coords, local_offset, time.monotonic() + timeout, fut))
        return fut

    def released(self) -> list[int]:
        """Local slots whose abandoned READ has been released since the last call."""
        out = []
        while True:
            try:
                out.append(self._released.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._inbox.put(None)
        self._thread.join(10)
        self._fetcher.shutdown(wait=False, cancel_futures=True)

    # ---- the puller thread ----

    def _run(self) -> None:
        try:
            while True:
                busy = self._inflight or self._waiting or self._zombies
                try:
                    job = self._inbox.get(timeout=POLL_S if busy else IDLE_S)
                except queue.Empty:
                    job = None
                else:
                    if job is None:
                        break
                    self._accept(job)
                self._advance_fetches()
                self._poll()
        except Exception as e:  # pragma: no cover - keep requests from hanging
            logger.error("encoderpool: the RDMA puller thread died: %r", e)
        finally:
            for j in self._waiting + self._inflight:
                self._release(j)
                self._finish(j, PullResult(False, "consumer shutting down", kind="failed"))
            self._teardown()

    def _teardown(self) -> None:
        """Disconnect every producer while this thread can still drive progress: UCX aborts
        the process at exit (arbiter assertion) if an endpoint to a dead peer still holds
        operations when the agent is destroyed."""
        for peer in self._peers.values():
            try:
                self._agent.remove_remote_agent(peer.name)
            except Exception as e:
                logger.debug("encoderpool: removing agent %s: %r", peer.name, e)
        self._peers.clear()
        for _ in range(20):
            try:
                self._agent.get_new_notifs()  # progress: lets the disconnects complete
            except Exception:
                break
            time.sleep(0.001)
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as e:
            logger.debug("encoderpool: deregistering the consumer region: %r", e)

    def _accept(self, job: _Job) -> None:
        key = (job.coords.host, job.coords.port)
        job.peer = key
        failed = self._failed_peers.get(key)
        if failed is not None and time.monotonic() - failed[0] < NEGATIVE_CACHE_S:
            self._finish(job, PullResult(False, failed[1], kind="unreachable"))
            return
        peer = self._peers.get(key)
        if peer is not None and not peer.stale and peer.info.agent == job.coords.agent:
            self._start_read(job, peer)
            return
        if peer is not None and not peer.stale and peer.fetched > job.started:
            self._finish(job, _agent_mismatch(job, peer))
            return
        self._waiting.append(job)
        if key not in self._fetching:
            self._fetching[key] = self._fetcher.submit(
                fetch_peer, key[0], key[1], self.metadata_timeout, self.key
            )

    def _advance_fetches(self) -> None:
        for key, fut in list(self._fetching.items()):
            if not fut.done():
                continue
            del self._fetching[key]
            waiters = [j for j in self._waiting if j.peer == key]
            self._waiting = [j for j in self._waiting if j.peer != key]
            try:
                info = fut.result()
                peer = self._add_peer(key, info)
            except AuthError as e:  # never handed to NIXL: no connect, no READ
                reason = f"side channel {key[0]}:{key[1]}: {e}"
                self._log.warn(f"{key[0]}:{key[1]}", str(e))
                self._failed_peers[key] = (time.monotonic(), reason)
                self._drop_peer(key)
                for j in waiters:
                    self._finish(j, PullResult(False, reason, kind="unauthenticated"))
                continue
            except (OSError, WireError, ValueError, RuntimeError) as e:
                reason = f"side channel {key[0]}:{key[1]}: {e}"
                self._failed_peers[key] = (time.monotonic(), reason)
                self._drop_peer(key)
                for j in waiters:
                    self._finish(j, PullResult(False, reason, kind="unreachable"))
                continue
            except Exception as e:  # NIXL rejects the metadata
                reason = f"producer {key[0]}:{key[1]} metadata: {e!r}"
                self._failed_peers[key] = (time.monotonic(), reason)
                for j in waiters:
                    self._finish(j, PullResult(False, reason, kind="bad_peer"))
                continue
            for j in waiters:
                if j.coords.agent == peer.info.agent:
                    self._start_read(j, peer)
                else:
                    self._finish(j, _agent_mismatch(j, peer))
        now = time.monotonic()
        for k in [k for k, (t, _) in self._failed_peers.items() if now - t > NEGATIVE_CACHE_S]:
            del self._failed_peers[k]  # bounded: only the last few seconds' failures
        for j in [j for j in self._waiting if now > j.deadline]:
            self._waiting.remove(j)
            self._finish(j, PullResult(False, "metadata fetch timed out", kind="timeout"))

    def _drop_peer(self, key: tuple[str, int]) -> None:
        """Forget a producer that stopped answering (pods come and go: do not pile up dead
        endpoints), unless a READ to it is still in flight."""
        peer = self._peers.get(key)
        if peer is None or any(j.peer == key for j in self._inflight):
            return
        del self._peers[key]
        try:
            self._agent.remove_remote_agent(peer.name)
        except Exception as e:
            logger.debug("encoderpool: removing agent %s: %r", peer.name, e)

    def _add_peer(self, key: tuple[str, int], info: PeerInfo) -> _Peer:
        if info.fingerprint != self.fingerprint:
            raise ValueError(
                f"serves model fingerprint {info.fingerprint}, this consumer {self.fingerprint}"
            )
        old = self._peers.get(key)
        if old is not None and old.info.agent == info.agent:
            old.stale = False
            old.fetched = time.monotonic()
            return old
        known = {p.name for p in self._peers.values()}
        if info.agent in known:
            raise ValueError(f"agent {info.agent} is already known under another address")
        name = self._agent.add_remote_agent(info.metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != info.agent:
            raise ValueError(f"metadata names agent {name!r}, the reply {info.agent!r}")
        try:
            # Set the endpoint up now rather than inside the first READ (wire-up over TCP).
            self._agent.make_connection(name)
        except Exception as e:
            logger.debug("encoderpool: connecting to %s ahead of the first READ: %r", name, e)
        peer = _Peer(info, name, time.monotonic())
        self._peers[key] = peer
        self._failed_peers.pop(key, None)
        if old is not None and not any(j.peer == key for j in self._inflight):
            try:
                self._agent.remove_remote_agent(old.name)
            except Exception as e:
                logger.debug("encoderpool: removing agent %s: %r", old.name, e)
        return peer

    def _start_read(self, job: _Job, peer: _Peer) -> None:
        c = job.coords
        if c.offset + c.size > peer.info.length:
            self._finish(
                job,
                PullResult(
                    False,
                    f"offset {c.offset} + size {c.size} is outside the producer's "
                    f"{peer.info.length}-byte region",
                    kind="bad_peer",
                ),
            )
            return
        try:
            local = self._agent.get_xfer_descs(
                [(self.region.address + job.local_offset, c.size, 0)], DRAM
            )
            remote = self._agent.get_xfer_descs([(peer.info.base + c.offset, c.size, 0)], DRAM)
            job.handle = self._agent.initialize_xfer(
                "READ", local, remote, peer.name, encode_release(c.offset, c.gen, self.key)
            )
            state = self._agent.transfer(job.handle)
        except Exception as e:
            self._release(job)
            peer.stale = True
            self._finish(job, PullResult(False, f"starting the READ failed: {e!r}", kind="failed"))
            return
        if state == "ERR":
            self._release(job)
            peer.stale = True
            self._finish(job, PullResult(False, "the READ failed to start", kind="failed"))
            return
        self._inflight.append(job)

    def _poll(self) -> None:
        now = time.monotonic()
        still: list[_Job] = []
        for job in self._inflight:
            try:
                state = self._agent.check_xfer_state(job.handle)
            except Exception as e:
                state = f"ERR {e!r}"
            if state == "DONE":
                self._release(job)
                self._finish(job, self._verify(job))
            elif state.startswith("ERR"):
                self._mark_stale(job)
                self._release(job)
                self._finish(job, PullResult(False, f"the READ failed: {state}", kind="failed"))
            elif now > job.deadline:
                self._mark_stale(job)
                released = self._release(job)
                self._finish(
                    job,
                    PullResult(False, "the READ timed out", slot_free=released, kind="timeout"),
                )
            else:
                still.append(job)
        self._inflight = still
        for handle, offset in list(self._zombies):
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as e:
                logger.debug("encoderpool: an abandoned READ is still held: %r", e)
                continue
            self._zombies.remove((handle, offset))
            self._released.put(offset)

    def _verify(self, job: _Job) -> PullResult:
        c = job.coords
        got = checksum(self.region.view[job.local_offset : job.local_offset + c.size])
        seconds = time.monotonic() - job.started
        if got != c.checksum:
            return PullResult(False, "checksum mismatch", seconds, kind="corrupt")
        return PullResult(True, seconds=seconds)

    def _release(self, job: _Job) -> bool:
        """Release the job's handle; False (and retried later) if NIXL still holds it."""
        if job.handle is None:
            return True
        try:
            self._agent.release_xfer_handle(job.handle)
            return True
        except Exception:
            self._zombies.append((job.handle, job.local_offset))
            return False
        finally:
            job.handle = None

    def _mark_stale(self, job: _Job) -> None:
        if job.peer is not None and job.peer in self._peers:
            self._peers[job.peer].stale = True

    @staticmethod
    def _finish(job: _Job, result: PullResult) -> None:
        if result.seconds == 0.0:
            result = PullResult(
                result.ok, result.reason, time.monotonic() - job.started, result.slot_free,
                result.kind,
            )  # fmt: skip
        if not job.future.done():
            job.future.set_result(result)


def _agent_mismatch(job: _Job, peer: _Peer) -> PullResult:
    return PullResult(
        False,
        f"{job.coords.host}:{job.coords.port} is agent {peer.info.agent}, the item names "
        f"{job.coords.agent} (the producer restarted, or the coordinates are wrong)",
        kind="bad_peer",
    )
