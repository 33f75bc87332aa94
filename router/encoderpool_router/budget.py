"""The router's memory budget: what connections and request bodies may hold, derived
from the container's memory limit, and the body budget kept at run time.

A router that runs out of memory is killed with every stream in flight. Its memory
is a baseline (the interpreter, its modules, the metrics) plus what clients make it
hold: each open connection, at worst a full unfinished request head and the buffers
of a request in flight (``connection_bytes``), and the bodies being read, parsed and
relayed. The plan (``plan``) keeps

    baseline + connections x connection_bytes + body budget  <=  75% of the limit

(the probe and metrics ports' few connections counted with the baseline) by deriving
the connection cap and the body budget from the limit, unless given; the
body budget is kept request by request (``BodyBudget``): a request reserves what its
body will cost before it is read (its declared length), and what parsing it will
cost before it is parsed (``body.parse_cost``), and gives it back when it is
answered. A request that does not fit is refused at once: 503 when the router is
full, 429 when its client holds its share, 413 when it could never fit a share.
"""

from __future__ import annotations

from dataclasses import dataclass

from encoderpool_router.listener import INTERNAL_LIMITS, worst_head_bytes
from encoderpool_router.protocol import Refused, over_share

MIB = 1 << 20
# Of the container's memory limit, what the plan may use: the rest is headroom for the
# allocator's fragmentation and what the estimates leave out.
HEADROOM = 0.75
# An idle router's resident memory (Python, aiohttp, the Kubernetes client, the
# metrics registry), with room: 53 MiB measured as a local process with static
# backends; in a pod discovery adds the Kubernetes client and its watch threads.
BASELINE_BYTES = 160 * MIB
# One connection beyond its head's bytes: aiohttp's parsed copy of the head (the
# header multidict and raw pairs: about the head again), the request's read-ahead
# buffer before the router reserves its body (two 64 KiB chunks and one 256 KiB
# socket read), and a relayed answer's buffers upstream and toward the client.
CONNECTION_EXTRA_BYTES = 640 << 10
# Of what the limit leaves for clients, the share of request bodies; the rest is for
# connections.
BODY_FRACTION = 0.5
# A client's share of the body budget, when not given.
CLIENT_FRACTION = 0.25
# What a body costs beyond its bytes at the least: the bytes as read and one copy for
# the parsed document (a base64 image's string). ``body.parse_cost`` is the estimate
# of the parse itself.
BODY_COPIES = 2


def connection_bytes(max_headers: int) -> int:
    """The most one client connection can make the router hold, its body aside."""
    return 2 * worst_head_bytes(max_headers) + CONNECTION_EXTRA_BYTES


# The probe and metrics listeners' connections, at their worst: counted with the baseline.
INTERNAL_BYTES = INTERNAL_LIMITS.max_connections * connection_bytes(INTERNAL_LIMITS.max_headers)


@dataclass(frozen=True)
class MemoryPlan:
    """Connection cap and body budget for one memory limit (see the module's docstring)."""

    max_connections: int
    body_bytes: int
    body_per_client_bytes: int

    def summary(self, memory_limit: int, max_headers: int) -> str:
        worst = BASELINE_BYTES + INTERNAL_BYTES + self.body_bytes
        worst += self.max_connections * connection_bytes(max_headers)
        return (
            f"{self.max_connections} connections, {self.body_bytes // MIB} MiB for bodies "
            f"({self.body_per_client_bytes // MIB} MiB per client); worst case "
            f"{worst // MIB} MiB of the {memory_limit // MIB} MiB limit"
        )


def plan(
    memory_limit: int,
    max_headers: int,
    max_body_bytes: int,
    max_connections: int | None = None,
    body_bytes: int | None = None,
    body_per_client_bytes: int | None = None,
) -> MemoryPlan:
    """The plan for ``memory_limit``: what is given is kept, the rest derived; ValueError
    (naming the flags) when what is given cannot fit the limit or serve the largest body."""
    usable = int(memory_limit * HEADROOM) - BASELINE_BYTES - INTERNAL_BYTES
    per_connection = connection_bytes(max_headers)
    if usable < 64 * MIB:
        raise ValueError(
            f"--memory-limit-bytes ({memory_limit // MIB} MiB) leaves no room for clients "
            f"beside the router's own {BASELINE_BYTES // MIB} MiB: give at least 512 MiB"
        )
    if body_bytes is None:
        fixed = 0 if max_connections is None else max_connections * per_connection
        body_bytes = int((usable - fixed) if max_connections else usable * BODY_FRACTION)
    if max_connections is None:
        max_connections = max(1, (usable - body_bytes) // per_connection)
    if body_per_client_bytes is None:
        body_per_client_bytes = int(body_bytes * CLIENT_FRACTION)
    worst = max_connections * per_connection + body_bytes
    if worst > usable or body_bytes <= 0:
        raise ValueError(
            f"--max-connections ({max_connections}) x {per_connection // 1024} KiB per "
            f"connection + --body-memory-bytes ({body_bytes // MIB} MiB) pass 75% of "
            f"--memory-limit-bytes ({memory_limit // MIB} MiB) less the router's own "
            f"{BASELINE_BYTES // MIB} MiB: lower them, or leave them unset to derive them"
        )
    if body_per_client_bytes > body_bytes:
        raise ValueError(
            f"--body-memory-per-client-bytes ({body_per_client_bytes // MIB} MiB) is over "
            f"--body-memory-bytes ({body_bytes // MIB} MiB)"
        )
    if BODY_COPIES * max_body_bytes > body_per_client_bytes:
        raise ValueError(
            f"--max-body-bytes ({max_body_bytes // MIB} MiB) costs up to "
            f"{BODY_COPIES * max_body_bytes // MIB} MiB once parsed, over a client's share "
            f"of body memory ({body_per_client_bytes // MIB} MiB): lower --max-body-bytes "
            "or raise --memory-limit-bytes (the container's limit) or the share"
        )
    return MemoryPlan(max_connections, body_bytes, body_per_client_bytes)


class Lease:
    """One request's hold on the body budget; it only grows, and is given back whole
    when the request is answered (``with budget.lease(client) as lease``)."""

    __slots__ = ("budget", "client", "held")

    def __init__(self, budget: BodyBudget, client: str) -> None:
        self.budget = budget
        self.client = client
        self.held = 0

    def grow_to(self, n: int) -> None:
        """Hold ``n`` bytes in all (no-op when already held); ``Refused`` when they do not fit."""
        if n > self.held:
            self.budget.take(self, n - self.held)
            self.held = n

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.budget.give_back(self)


class BodyBudget:
    """Body memory held, in all and per client; a client is forgotten when it holds none."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self.held = 0
        self._clients: dict[str, int] = {}

    def lease(self, client: str) -> Lease:
        """A lease for one request of ``client``, to hold with ``with`` (given back
        whatever happens)."""
        return Lease(self, client)

    def take(self, lease: Lease, n: int) -> None:
        mine = self._clients.get(lease.client, 0)
        if lease.held + n > self.per_client:
            raise Refused(
                413,
                f"this request needs {(lease.held + n) // MIB + 1} MiB of router memory to "
                f"read and parse, over a client's share of {self.per_client // MIB} MiB: "
                "send a smaller body (fewer or smaller inline media, or media URLs)",
                "invalid_request_error",
                "body_memory",
            )
        if mine + n > self.per_client:
            raise over_share(
                f"at most {self.per_client // MIB} MiB of request bodies in flight per client",
                "client_body_memory",
            )
        if self.held + n > self.total:
            raise Refused(
                503,
                "the router holds as many request bodies as it can; retry in a moment",
                "service_unavailable",
                "body_memory_full",
                retry_after=True,
            )
        self.held += n
        self._clients[lease.client] = mine + n

    def give_back(self, lease: Lease) -> None:
        if not lease.held:
            return
        self.held -= lease.held
        left = self._clients[lease.client] - lease.held
        if left:
            self._clients[lease.client] = left
        else:
            del self._clients[lease.client]
        lease.held = 0
