"""The HTTP surface the router speaks with clients: its paths, the request id, and the
OpenAI-style errors it answers itself.

A step of the request walk that refuses a request raises ``Refused``; the walk answers
it (``pipeline``), so each step says what is wrong in one line and nothing else.
"""

from __future__ import annotations

import os
from typing import Any

from aiohttp import web

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
VERSION_PATH = "/version"
# Open without a client token: what the kubelet's probes call.
PROBE_PATHS = frozenset({"/health", "/livez"})
REQUEST_ID = "x-request-id"
TOO_DEEP = "request body is nested too deeply"
INVALID = "invalid_request_error"


def request_id(request: web.Request) -> str:
    """The client's ``x-request-id``, or 32 new random hex digits."""
    return request.headers.get(REQUEST_ID) or os.urandom(16).hex()


def error_response(
    status: int,
    message: str,
    kind: str,
    rid: str,
    param: str | None = None,
    anthropic: bool = False,
) -> web.Response:
    """An OpenAI-style error body (with ``param`` when one field is at fault, as vLLM's),
    or Anthropic's (``anthropic``: the Messages API's clients read that shape)."""
    body: dict[str, Any]
    if anthropic:
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
        if param is None:
            del body["error"]["param"]
    return web.json_response(body, status=status, headers={REQUEST_ID: rid})


class Refused(Exception):
    """A request the router answers itself with an error, before anything more of it
    goes upstream.

    ``kind``: the OpenAI error type; ``counted``: the kind in
    ``encoderpool_router_errors_total``; ``retry_after``: a share is full, try again in
    a second; ``close``: drop the connection (the rest of a slow body is not worth
    waiting for); ``param``: the field at fault, where vLLM names one for the same error.
    """

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        counted: str,
        *,
        retry_after: bool = False,
        close: bool = False,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.counted = counted
        self.retry_after = retry_after
        self.close = close
        self.param = param

    def response(self, rid: str, anthropic: bool = False) -> web.Response:
        response = error_response(self.status, self.message, self.kind, rid, self.param, anthropic)
        if self.retry_after:
            response.headers["Retry-After"] = "1"
        if self.close:
            response.force_close()
        return response


def over_share(message: str, counted: str) -> Refused:
    """A 429 for a client past its share: retry in a moment."""
    return Refused(429, f"{message}; retry later", "rate_limit_error", counted, retry_after=True)


def invalid(message: str, counted: str = "bad_request") -> Refused:
    """A 400: the request itself is wrong."""
    return Refused(400, message, INVALID, counted)
