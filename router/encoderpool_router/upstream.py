"""The one HTTP session every producer and consumer request goes through.

One aiohttp session for all upstream requests: no connection limit, no cookie jar (a
cookie a backend set must never ride along on another client's request), bodies passed
through as the backend sent them. Every upstream request carries the router's own key
(``--backend-api-key``), never the client's ``Authorization``: producers and consumers
answer /v1 only to the router.
"""

from __future__ import annotations

import aiohttp
from aiohttp.abc import AbstractResolver
from pydantic import SecretStr

from encoderpool_router.protocol import REQUEST_ID

JSON = "application/json"
# Idle upstream connections are dropped before vLLM drops them (uvicorn's keep-alive,
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE, is 5 s): a request on a connection that vLLM closes at
# that moment fails ("connection reset"), which would eject a healthy producer, or send
# a consumer's request to another one without its params, after every lull.
UPSTREAM_KEEPALIVE_S = 4.0


class UpstreamError(Exception):
    """A backend could not be reached or did not answer usably.

    ``kind``: the error kind counted. ``eject``: the backend itself looks down (refused,
    timed out; a producer's 5xx or answer without params), so it is avoided for a while.
    A consumer's HTTP error and a producer's 4xx do not eject: they may be the
    request's own fault.
    """

    def __init__(self, kind: str, message: str, eject: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.eject = eject


class Upstream:
    """The session (open while the app runs) and the headers of every upstream request."""

    def __init__(
        self, backend_api_key: SecretStr | None, resolver: AbstractResolver | None = None
    ) -> None:
        self._resolver = resolver  # None: aiohttp's default (the system's DNS)
        self._session: aiohttp.ClientSession | None = None
        self._auth: dict[str, str] = {}
        if backend_api_key is not None:
            self._auth = {"Authorization": f"Bearer {backend_api_key.get_secret_value()}"}

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the app's startup has not run"
        return self._session

    def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S, resolver=self._resolver
            ),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def headers(self, rid: str, json_body: bool) -> dict[str, str]:
        """The request id, the router's key, and the content type of a JSON body."""
        headers = {REQUEST_ID: rid, **self._auth}
        if json_body:
            headers["Content-Type"] = JSON
        return headers
