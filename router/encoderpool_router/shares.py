"""Each client's share of the router: requests and producer items in flight.

Clients of a pool do not trust each other. Without a share, one client's hundreds
of slow items hold every producer slot and everyone else's items wait for them (or
fall back to the consumers); with one, a client past its share is told so at once
(429) and the others keep their slots. A client is its bearer token when the router
checks tokens, else the address it connects from (behind a proxy every client
shares the proxy's address: turn tokens on for real per-client shares).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from encoderpool_router.auth import bearer_token, client_bytes
from encoderpool_router.protocol import over_share


def client_of(request: web.Request, by_token: bool) -> str:
    """Who a request counts against: a digest of its bearer token (never the token: the
    key may end up in a debugger or a dump), or its peer address."""
    if by_token:
        token = bearer_token(request.headers.get("Authorization"))
        if token is not None:
            return "token:" + hashlib.sha256(client_bytes(token)).hexdigest()[:32]
    return "addr:" + (request.remote or "unknown")


class Shares:
    """Counts in flight per client, each bounded; a client is forgotten when it has
    nothing in flight, so the table is never larger than the requests in flight."""

    def __init__(self, max_requests: int, max_items: int) -> None:
        self.max_requests = max_requests
        self.max_items = max_items
        self._requests: dict[str, int] = {}
        self._items: dict[str, int] = {}

    @contextmanager
    def request(self, client: str) -> Iterator[None]:
        """One request of ``client`` in flight for the block; ``Refused`` (429) past its share."""
        if not self.admit(client):
            message = f"at most {self.max_requests} requests in flight per client"
            raise over_share(message, "client_requests_limit")
        try:
            yield
        finally:
            self.leave(client)

    @contextmanager
    def items(self, client: str, n: int) -> Iterator[None]:
        """``n`` items of ``client`` at the producers for the block; ``Refused`` (429) past
        its share."""
        if not self.reserve_items(client, n):
            message = f"at most {self.max_items} media items in flight per client"
            raise over_share(message, "client_items_limit")
        try:
            yield
        finally:
            self.release_items(client, n)

    def admit(self, client: str) -> bool:
        """One more request of ``client``, unless it has ``max_requests`` in flight."""
        n = self._requests.get(client, 0)
        if n >= self.max_requests:
            return False
        self._requests[client] = n + 1
        return True

    def leave(self, client: str) -> None:
        n = self._requests[client] - 1
        if n:
            self._requests[client] = n
        else:
            del self._requests[client]

    def reserve_items(self, client: str, n: int) -> bool:
        """``n`` producer items for ``client``, all or none: a request is encoded whole
        within the share or refused, never left half-encoded."""
        held = self._items.get(client, 0)
        if held + n > self.max_items:
            return False
        self._items[client] = held + n
        return True

    def release_items(self, client: str, n: int) -> None:
        held = self._items[client] - n
        if held:
            self._items[client] = held
        else:
            del self._items[client]

    def clients(self) -> int:
        """Clients with anything in flight."""
        return len(self._requests.keys() | self._items.keys())
