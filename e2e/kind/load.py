"""Traffic for a pool on kind, and its Deployments' replicas sampled while it runs.

``Load`` runs closed-loop clients against a pool's router (through a port-forward):
each sends one streamed chat request at a time, the next body from a shared sequence,
until stopped, and every answer is kept (status, time to first token, token ids). The
bodies are deterministic (``image_body`` / ``text_body`` of an index), so a monolithic
server can be asked the same afterwards and the answers compared token by token.

``ReplicaSampler`` reads the namespace's Deployments every ``interval`` seconds in a
thread: spec and ready replicas, and who manages ``spec.replicas`` (managedFields), so a
test can say what a role's count was at any moment of a phase, and a benchmark can
integrate replica-seconds.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from e2e.kind.cluster import KindCluster
from e2e.media import chat_request, image
from encoderpool_operator.naming import replicas_managers

# A side the tiny model's encoder takes ~0.2 s per image for on one core: enough encoder
# work per item for the producers' demand signal to ask for a second pod.
HEAVY_IMAGE_PX = 448
TEXTS = (
    "Write a short story about a lighthouse keeper.",
    "List the planets of the solar system and say one thing about each.",
    "Explain how a bicycle stays upright.",
    "Describe the rules of chess to a child.",
    "What makes bread rise? Answer in detail.",
    "Tell me about the history of the printing press.",
)


def image_body(index: int, images: int = 1, max_tokens: int = 4) -> dict[str, Any]:
    """An image-heavy request: ``images`` new images (index-derived: no two indices, nor
    two values of ``images``, share one) and a short answer: the encoders carry it."""
    side = (HEAVY_IMAGE_PX, HEAVY_IMAGE_PX)
    first = 1_000_000 * images + images * index
    pngs = [image(first + k, size=side) for k in range(images)]
    return chat_request(*pngs, max_tokens=max_tokens, stream=True)


def text_body(index: int, max_tokens: int = 48) -> dict[str, Any]:
    """A text-only request with a long answer: the LM carries it, no encoder."""
    body = chat_request(text=TEXTS[index % len(TEXTS)], max_tokens=max_tokens, stream=True)
    body["ignore_eos"] = True  # every answer max_tokens long: a steady LM load
    return body


@dataclass(frozen=True)
class Answer:
    """One request of a load: which body, when it left, what came back."""

    key: tuple[str, int]  # (kind, index): the body it sent, see Load.body
    started: float  # time.monotonic()
    seconds: float
    status: int  # 0: no HTTP answer (connection failed or timed out)
    ttft_s: float | None
    token_ids: tuple[int, ...]
    error: str = ""


class ChatClient:
    """One client's connection to ``url``, kept alive from request to request.

    Through a port-forward each new connection is a new stream set up by kubectl, the API
    server and the kubelet; on busy cores that took seconds, and a load of short requests
    then spent more time connecting than in vLLM. A connection the server closed while
    idle is opened again and the request sent once more (nothing of it was answered)."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def chat(self, body: dict[str, Any]) -> tuple[int, float | None, list[int], str]:
        """POST a streamed chat request; (status, seconds to the first token, token ids,
        error); status 0: no HTTP answer (refused, reset, timed out, a torn stream)."""
        data = json.dumps(body).encode()
        for attempt in (1, 2):
            reused = self._conn is not None
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            t0 = time.monotonic()
            try:
                self._conn.request(
                    "POST", "/v1/chat/completions", data, {"Content-Type": "application/json"}
                )
                r = self._conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                self.close()
                if reused and attempt == 1:
                    continue  # closed while idle: nothing was answered, send it again
                return 0, None, [], f"{type(e).__name__}: {e}"
            except OSError as e:
                self.close()
                return 0, None, [], f"{type(e).__name__}: {e}"
            return self._read(r, t0)
        raise AssertionError("unreachable")

    def _read(
        self, r: http.client.HTTPResponse, t0: float
    ) -> tuple[int, float | None, list[int], str]:
        ttft: float | None = None
        ids: list[int] = []
        try:
            if r.status != 200:
                return r.status, None, [], r.read().decode(errors="replace")[:300]
            error = ""
            while raw := r.readline():
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    error = json.dumps(chunk["error"])[:300]
                for choice in chunk.get("choices", []):
                    if choice.get("token_ids"):
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        ids += choice["token_ids"]
            r.read()  # the end of the body: the connection is ready for the next request
            return r.status, ttft, ids, error
        except (OSError, ValueError, http.client.HTTPException) as e:
            self.close()
            return 0, None, ids, f"{type(e).__name__}: {e}"
        finally:
            if r.will_close:
                self.close()


class Load:
    """``clients`` closed-loop clients sending ``kind`` bodies (``image`` or ``text``) to
    ``url`` until ``stop``; indices count up from ``first`` across all clients."""

    # What each kind of body is; text bodies repeat every len(TEXTS) (their key says which).
    BODIES: dict[str, Callable[[int], dict[str, Any]]] = {"image": image_body, "text": text_body}
    PERIOD = {"text": len(TEXTS)}

    def __init__(
        self, url: str, kind: str, clients: int, first: int = 0, timeout: float = 300
    ) -> None:
        self.url = url
        self.kind = kind
        self.timeout = timeout
        self.answers: list[Answer] = []
        self._next = itertools.count(first)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, name=f"load-{kind}-{i}", daemon=True)
            for i in range(clients)
        ]

    @classmethod
    def body(cls, key: tuple[str, int]) -> dict[str, Any]:
        return cls.BODIES[key[0]](key[1])

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def failed(self) -> list[Answer]:
        """The failures so far (a caller waiting on the load gives up at the first)."""
        with self._lock:
            return failures(self.answers)

    def stop(self) -> list[Answer]:
        """Stop sending; wait for the requests in flight; every answer, in start order."""
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 30)
        return sorted(self.answers, key=lambda a: a.started)

    def _client(self) -> None:
        client = ChatClient(self.url, self.timeout)
        try:
            while not self._stop.is_set():
                with self._lock:
                    n = next(self._next)
                    key = (self.kind, n % self.PERIOD[self.kind] if self.kind in self.PERIOD else n)
                t0 = time.monotonic()
                status, ttft, ids, error = client.chat(self.body(key))
                answer = Answer(key, t0, time.monotonic() - t0, status, ttft, tuple(ids), error)
                with self._lock:
                    self.answers.append(answer)
        finally:
            client.close()


def failures(answers: Iterable[Answer]) -> list[Answer]:
    """Answers that are not a 200 with tokens."""
    return [a for a in answers if a.status != 200 or a.error or not a.token_ids]


def mismatches(
    answers: Sequence[Answer], expected: dict[tuple[str, int], tuple[int, ...]]
) -> list[tuple[Answer, tuple[int, ...]]]:
    """Answers whose tokens differ from ``expected`` (a monolithic server's, by body)."""
    return [(a, expected[a.key]) for a in answers if a.token_ids != expected[a.key]]


def monolithic_answers(
    url: str, keys: Iterable[tuple[str, int]], clients: int = 3, timeout: float = 300
) -> dict[tuple[str, int], tuple[int, ...]]:
    """The token ids a server at ``url`` (a monolithic vLLM) gives each body, asked by
    ``clients`` threads at once; raises if any is not a 200 with tokens."""
    todo = sorted(set(keys))
    out: dict[tuple[str, int], tuple[int, ...]] = {}
    refused: list[str] = []
    lock = threading.Lock()
    it = iter(todo)

    def client() -> None:
        chat = ChatClient(url, timeout)
        while True:
            with lock:
                key = next(it, None)
            if key is None:
                chat.close()
                return
            status, _, ids, error = chat.chat(Load.body(key))
            with lock:
                if status != 200 or error or not ids:
                    refused.append(f"{key}: {status} {error}")
                else:
                    out[key] = tuple(ids)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if refused or len(out) != len(todo):
        raise RuntimeError(
            f"the monolithic server did not answer {len(todo) - len(out)}: {refused[:3]}"
        )
    return out


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic()
    replicas: int | None  # spec.replicas
    existing: int  # status.replicas: pods that exist (started or starting)
    ready: int
    managers: tuple[str, ...]  # who manages spec.replicas


@dataclass
class ReplicaSampler:
    """The namespace's Deployments read every ``interval`` s in a thread (one
    ``kubectl get deployments`` per read), by Deployment name."""

    kind: KindCluster
    namespace: str
    interval: float = 1.0
    samples: dict[str, list[Sample]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replicas", daemon=True)
        self.errors = 0

    def start(self) -> ReplicaSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def __enter__(self) -> ReplicaSampler:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def read(self) -> None:
        out = self.kind.kubectl(
            "get", "deployments", "-n", self.namespace, "-o", "json", "--show-managed-fields",
            check=False, timeout=30,
        )  # fmt: skip
        now = time.monotonic()
        try:
            items = json.loads(out)["items"]
        except (ValueError, KeyError):
            self.errors += 1  # the API server busy for a moment: the next read counts
            return
        for d in items:
            spec, st = d.get("spec", {}), d.get("status", {})
            self.samples.setdefault(d["metadata"]["name"], []).append(
                Sample(
                    now,
                    spec.get("replicas"),
                    int(st.get("replicas", 0)),
                    int(st.get("readyReplicas", 0)),
                    replicas_managers(d),
                )
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.read()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def of(self, name: str, since: float = 0.0, until: float = float("inf")) -> list[Sample]:
        return [s for s in self.samples.get(name, []) if since <= s.at <= until]

    def latest(self, name: str) -> Sample | None:
        got = self.samples.get(name)
        return got[-1] if got else None

    def replica_seconds(self, name: str, since: float, until: float) -> float:
        """The integral of the Deployment's existing pods over [since, until] (each sample
        holds until the next): what the role cost in that time."""
        total = 0.0
        seen = self.of(name)
        for s, nxt in zip(seen, [*seen[1:], None], strict=True):
            start = max(s.at, since)
            end = min(nxt.at if nxt else until, until)
            if end > start:
                total += s.existing * (end - start)
        return total
