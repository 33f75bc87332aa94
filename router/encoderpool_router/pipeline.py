"""One client request's walk through the router.

    read the body → classify its content parts → admit its items (the client's share)
    → encode them on producers → choose a consumer and relay its answer
    → once the consumer accepted it, count its items that found no producer ready

``Pipeline.walk`` is that list, one line a step; each step is a unit of its own
(``intake``, ``shares``, ``encode``, ``relay``). A step that refuses the request raises
``Refused``, which ``Pipeline.handle`` answers. ``handle`` also holds the client's
request share and its lease on the body memory budget (given back once answered), and
counts every request once, by endpoint and status; handlers run with
aiohttp's handler cancellation on, so a client that disconnects cancels the upstream
requests (closing their connections makes vLLM abort them), counted as status 499.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from encoderpool_router.anthropic import read_blocks_media
from encoderpool_router.budget import BodyBudget, Lease
from encoderpool_router.config import RouterSettings
from encoderpool_router.content import ReadItems, read_media
from encoderpool_router.encode import Encoder
from encoderpool_router.intake import Reader, check_media_urls, classify, read_body
from encoderpool_router.metrics import RouterMetrics
from encoderpool_router.protocol import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    COUNT_TOKENS_PATH,
    DETOKENIZE_PATH,
    MESSAGES_PATH,
    MODELS_PATH,
    RESPONSES_PATH,
    TOKENIZE_PATH,
    VERSION_PATH,
    Refused,
    request_id,
)
from encoderpool_router.relay import ClientGone, Relay
from encoderpool_router.responses import read_input_media, unsupported
from encoderpool_router.shares import Shares, client_of

logger = logging.getLogger(__name__)


def _read_responses(body: dict[str, Any], trust_ids: bool) -> ReadItems:
    if refused := unsupported(body):
        raise refused
    return read_input_media(body, trust_ids)


@dataclass(frozen=True)
class Endpoint:
    """An endpoint the router serves: ``body``, a POST with a JSON body; ``reader``, how
    its media items are read (None: it carries none); ``encode``, its items go to
    producers (counting tokens reads media without running the encoder: the items are
    only checked); ``anthropic``, the router's own errors in Anthropic's shape."""

    path: str
    body: bool
    reader: Reader | None = None
    encode: bool = False
    anthropic: bool = False


CHAT = Endpoint(CHAT_PATH, body=True, reader=read_media, encode=True)
COMPLETIONS = Endpoint(COMPLETIONS_PATH, body=True)  # prompts hold no media
MODELS = Endpoint(MODELS_PATH, body=False)
RESPONSES = Endpoint(RESPONSES_PATH, body=True, reader=_read_responses, encode=True)
MESSAGES = Endpoint(MESSAGES_PATH, body=True, reader=read_blocks_media, encode=True, anthropic=True)
COUNT_TOKENS = Endpoint(COUNT_TOKENS_PATH, body=True, reader=read_blocks_media, anthropic=True)
# /tokenize takes a completion prompt or chat messages (their images count as tokens).
TOKENIZE = Endpoint(TOKENIZE_PATH, body=True, reader=read_media)
DETOKENIZE = Endpoint(DETOKENIZE_PATH, body=True)
VERSION = Endpoint(VERSION_PATH, body=False)
# Every endpoint the router serves, with its method: what a 404 lists.
ENDPOINTS = {
    CHAT: "POST",
    COMPLETIONS: "POST",
    MODELS: "GET",
    RESPONSES: "POST",
    MESSAGES: "POST",
    COUNT_TOKENS: "POST",
    TOKENIZE: "POST",
    DETOKENIZE: "POST",
    VERSION: "GET",
}


class Pipeline:
    """The request walk over the router's parts."""

    def __init__(
        self,
        settings: RouterSettings,
        metrics: RouterMetrics,
        shares: Shares,
        budget: BodyBudget,
        encoder: Encoder,
        relay: Relay,
        clients_by_token: bool,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.shares = shares
        self.budget = budget
        self.encoder = encoder
        self.relay = relay
        self.clients_by_token = clients_by_token

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """The request walked within its client's share; one status counted per request."""
        rid = request_id(request)
        client = client_of(request, by_token=self.clients_by_token)
        code = "500"
        try:
            with self.shares.request(client), self.budget.lease(client) as lease:  # 429
                response = await self.walk(request, endpoint, rid, client, lease)
            code = str(response.status)
            return response
        except Refused as refused:
            self.metrics.error(refused.counted)
            code = str(refused.status)
            return refused.response(rid, endpoint.anthropic)
        except ClientGone as gone:
            code = "499"  # nginx's "client closed request"
            self.metrics.error("client_disconnect")
            logger.info("request %s: the client went away mid-stream", rid)
            return gone.response
        except asyncio.CancelledError:
            code = "499"
            self.metrics.error("client_disconnect")
            logger.info("request %s: the client went away; upstream work cancelled", rid)
            raise
        except web.HTTPException as e:  # aiohttp answers it (413: a body over the limit)
            code = str(e.status)
            raise
        finally:
            self.metrics.request(endpoint.path, code)

    async def walk(
        self, request: web.Request, endpoint: Endpoint, rid: str, client: str, lease: Lease
    ) -> web.StreamResponse:
        """Read → classify → admit → encode → choose a consumer and relay (the items that
        found no producer ready counted once the consumer accepted the request)."""
        if not endpoint.body:
            return await self.relay.forward(request, endpoint.path, None, {}, None, rid)
        body = await read_body(request, self.settings, lease)  # 408, 413, 400, 429, 503
        media = classify(body, endpoint.reader, self.settings)  # 400 (404: a stored response)
        await check_media_urls(media, self.settings)  # 400
        params: dict[str, Any] = {}
        unserved: list[tuple[str, bytes]] = []
        if media.parts and endpoint.encode:
            with self.shares.items(client, media.distinct):  # 429
                params, unserved = await self.encoder.encode(body, media, rid)

        def accepted() -> None:  # the wake signal: never for a request the consumer refused
            self.encoder.unserved(client, unserved)

        return await self.relay.forward(
            request, endpoint.path, body, params, media.affinity, rid, accepted
        )
