"""The vLLM pods' API guard, as plain ASGI (tests/router/test_vllm.py runs it inside vLLM)."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import pytest

from encoderpool_connector.programs.api_guard import RequireApiKey
from encoderpool_contracts.pod import API_GUARD_MIDDLEWARE

KEY = "pool-key-" + "k" * 32


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def status(path: str, authorization: bytes | None = None, kind: str = "http") -> int | str:
    headers = [(b"content-type", b"application/json")]
    if authorization is not None:
        headers.append((b"Authorization", authorization))
    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {"type": kind, "path": path, "root_path": "", "method": "POST", "headers": headers}
    asyncio.run(RequireApiKey(_app)(scope, receive, send))
    if sent[0]["type"] == "websocket.close":
        return "closed"
    return int(sent[0]["status"])


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", KEY)


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/invocations", "/tokenize", "/scale_elastic_ep", "/x"]
)
def test_every_route_needs_the_key(path: str) -> None:
    for wrong in (None, b"", b"Bearer", b"Bearer wrong", b"Basic " + KEY.encode(), KEY.encode()):
        assert status(path, wrong) == 401, wrong
    assert status(path, f"Bearer {KEY}".encode()) == 200
    assert status(path, f"bearer  {KEY} ".encode()) == 200
    assert status(path, None, kind="websocket") == "closed"


@pytest.mark.parametrize("path", ["/health", "/metrics", "/metrics/"])
def test_probes_and_scrapers_need_none(path: str) -> None:
    assert status(path) == 200


def test_without_a_key_it_refuses_to_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "")
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is empty"):
        RequireApiKey(_app)


def test_vllm_can_import_what_the_operator_names() -> None:
    module, name = API_GUARD_MIDDLEWARE.rsplit(".", 1)
    assert getattr(__import__(module, fromlist=[name]), name) is RequireApiKey
