"""An ASGI middleware for the pool's vLLM servers: every route needs the pool's key.

vLLM's own ``--api-key`` (``VLLM_API_KEY``) guards only paths under ``/v1``,
``/v2``, ``/inference`` and ``/cohere``. The same server also answers
``/invocations`` (SageMaker's entry point, which runs chat completions),
``/tokenize``, ``/scale_elastic_ep`` and more without it, so a neighbour that
reaches a producer or consumer could still use it. This guard refuses every
request without ``Authorization: Bearer <VLLM_API_KEY>`` except the kubelet's
probe (``/health``) and the scrapers' ``/metrics``. The operator loads it with
``vllm serve --middleware`` and the contracts' ``API_GUARD_MIDDLEWARE``; it depends
on nothing but the standard library and the contracts' names.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from encoderpool_contracts.pod import API_GUARD_MIDDLEWARE, VLLM_API_KEY_ENV

# Answered without the key: the kubelet's probes and Prometheus scrapers.
OPEN_PATHS = frozenset({"/health", "/metrics", "/metrics/"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class RequireApiKey:
    """Refuse (401) any HTTP or websocket request but OPEN_PATHS without the bearer key.

    The key is ``VLLM_API_KEY``, read once at start; without one the server refuses
    to serve anything (fail closed: a RuntimeError names the variable).
    """

    def __init__(self, app: App) -> None:
        key = os.environ.get(VLLM_API_KEY_ENV, "")
        if not key:
            raise RuntimeError(
                f"{VLLM_API_KEY_ENV} is empty: {API_GUARD_MIDDLEWARE} refuses to serve "
                "without a key (the operator sets it from the pool's internal Secret)"
            )
        self.app = app
        self._want = _digest(f"Bearer {key}".encode())

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                given = b"Bearer " + token.strip() if scheme.lower() == b"bearer" else b""
                return hmac.compare_digest(_digest(given), self._want)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] not in ("http", "websocket")
            or scope.get("path", "").removeprefix(scope.get("root_path", "")) in OPEN_PATHS
            or self._authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        body = json.dumps({"error": {"message": "Unauthorized", "code": 401}}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
