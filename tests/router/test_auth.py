"""Authentication at the router: client bearer tokens in front, the router's own key behind.

In-process fakes here (what each side sees, header by header); tests/router/test_vllm.py
shows the same against real vLLM servers that hold an API key.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from e2e.media import chat_request, image
from encoderpool_router.auth import TokenFile, bearer_token, parse_tokens
from tests.router.fixtures import FakeBackend, fakes, router_at, run

TOKEN_A = "tok-a-" + "x" * 40
TOKEN_B = "tok-b-" + "y" * 40
BACKEND_KEY = "backend-key-" + "z" * 40


async def call(
    s: aiohttp.ClientSession, method: str, url: str, token: str | None = None, **kw: Any
) -> tuple[int, Any, dict[str, str]]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with s.request(method, url, headers=headers, **kw) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


def test_client_tokens_guard_every_route_but_the_probes(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_A}\n\n  {TOKEN_B}  \n")
    producer, consumer = FakeBackend("producer"), FakeBackend("consumer")

    async def scenario() -> None:
        async with (
            fakes(producer, consumer) as (purl, curl),
            router_at([purl], [curl], auth_token_file=tokens) as (router, url),
            aiohttp.ClientSession() as s,
        ):
            chat = url + "/v1/chat/completions"
            body = chat_request(image(1))
            for token in (None, "wrong", TOKEN_A + "x", TOKEN_A[:-1]):
                status, answer, headers = await call(s, "POST", chat, token, json=body)
                assert status == 401, token
                assert answer["error"]["type"] == "authentication_error"
                assert headers["WWW-Authenticate"].startswith("Bearer")
            for path in ("/v1/models", "/v1/completions", "/nowhere"):
                method = "GET" if path != "/v1/completions" else "POST"
                assert (await call(s, method, url + path, json={}))[0] == 401, path
            # A header that is not a bearer token, or a Basic one carrying the token.
            async with s.post(chat, json=body, headers={"Authorization": TOKEN_A}) as r:
                assert r.status == 401
            basic = "Basic " + base64.b64encode(f"u:{TOKEN_A}".encode()).decode()
            async with s.post(chat, json=body, headers={"Authorization": basic}) as r:
                assert r.status == 401
            assert producer.seen + consumer.seen == []  # refused before any upstream
            refused = router.metrics.registry.get_sample_value(
                "encoderpool_router_errors_total", {"kind": "unauthorized"}
            )
            assert refused == 9

            for token in (TOKEN_A, TOKEN_B):  # either token of the file
                status, answer, _ = await call(s, "POST", chat, token, json=body)
                assert status == 200, answer
            async with s.post(
                chat, json=body, headers={"Authorization": f"bearer  {TOKEN_B}"}
            ) as r:
                assert r.status == 200  # the scheme is case-insensitive (RFC 7235)
            for path in ("/health", "/livez"):  # probes carry no token
                assert (await call(s, "GET", url + path))[0] == 200, path

    run(scenario())


def test_a_rotated_token_file_is_followed_without_a_restart(tmp_path: Path) -> None:
    """As Kubernetes updates a mounted Secret: new files, then the link swapped to them."""
    data = tmp_path / "..data_1"
    data.mkdir()
    (data / "tokens").write_text(TOKEN_A + "\n")
    link = tmp_path / "..data"
    link.symlink_to(data.name)
    (tmp_path / "tokens").symlink_to("..data/tokens")
    consumer = FakeBackend("consumer")

    async def scenario() -> None:
        async with (
            fakes(consumer) as (curl,),
            router_at([], [curl], auth_token_file=tmp_path / "tokens") as (router, url),
            aiohttp.ClientSession() as s,
        ):
            assert router.tokens is not None
            router.tokens.recheck_s = 0.0  # the router looks once a second; a test, always
            models = url + "/v1/models"
            assert (await call(s, "GET", models, TOKEN_A))[0] == 200
            assert (await call(s, "GET", models, TOKEN_B))[0] == 401

            def swap(content: str, n: int) -> None:
                new = tmp_path / f"..data_{n}"
                new.mkdir()
                (new / "tokens").write_text(content)
                tmp = tmp_path / "..data_tmp"
                tmp.symlink_to(new.name)
                os.replace(tmp, link)  # atomic, as the kubelet's AtomicWriter does

            swap(f"{TOKEN_A}\n{TOKEN_B}\n", 2)  # roll the new token in beside the old
            assert (await call(s, "GET", models, TOKEN_A))[0] == 200
            assert (await call(s, "GET", models, TOKEN_B))[0] == 200
            swap(f"{TOKEN_B}\n", 3)  # then revoke the old one
            assert (await call(s, "GET", models, TOKEN_A))[0] == 401
            assert (await call(s, "GET", models, TOKEN_B))[0] == 200
            swap("", 4)  # emptied: nobody gets in (fail closed), probes still answer
            assert (await call(s, "GET", models, TOKEN_B))[0] == 401
            assert (await call(s, "GET", url + "/health"))[0] == 200

    run(scenario())


def test_upstream_requests_carry_the_router_s_key_never_the_client_s(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN_A)
    producer, consumer = FakeBackend("producer"), FakeBackend("consumer")

    async def scenario() -> None:
        async with (
            fakes(producer, consumer) as (purl, curl),
            router_at([purl], [curl], auth_token_file=tokens, backend_api_key=BACKEND_KEY) as (
                _,
                url,
            ),
            aiohttp.ClientSession() as s,
        ):
            body = chat_request(image(1), image(2))
            status, _, _ = await call(s, "POST", url + "/v1/chat/completions", TOKEN_A, json=body)
            assert status == 200
            assert (await call(s, "GET", url + "/v1/models", TOKEN_A))[0] == 200

    run(scenario())
    seen = producer.seen + consumer.seen
    assert (len(producer.seen), len(consumer.seen)) == (2, 2)
    assert {r.headers.get("authorization") for r in seen} == {f"Bearer {BACKEND_KEY}"}


def test_without_a_backend_key_no_authorization_goes_upstream() -> None:
    consumer = FakeBackend("consumer")

    async def scenario() -> None:
        async with (
            fakes(consumer) as (curl,),
            router_at([], [curl]) as (_, url),
            aiohttp.ClientSession() as s,
        ):
            status, _, _ = await call(s, "GET", url + "/v1/models", token="client-token")
            assert status == 200  # no client auth configured: open

    run(scenario())
    (seen,) = consumer.seen
    assert "authorization" not in seen.headers  # the client's header is not passed on


@pytest.mark.parametrize(
    ("header", "token"),
    [
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("Basic dTpw", None),
        ("Bearer abc", "abc"),
        ("bearer abc", "abc"),
        ("BEARER   abc  ", "abc"),
    ],
)
def test_bearer_header_parsing(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def test_token_file_lines() -> None:
    assert parse_tokens("a\n\n  b \r\n\t\n") == ("a", "b")


def test_a_token_file_that_vanishes_keeps_the_tokens_read_before(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(TOKEN_A)
    now = [0.0]
    tokens = TokenFile(path, recheck_s=1.0, clock=lambda: now[0])
    tokens.load()
    path.unlink()  # mid-swap, say
    now[0] = 5.0
    assert tokens.accepts(f"Bearer {TOKEN_A}")
    path.write_text(TOKEN_B)
    now[0] = 5.5  # within recheck_s: not looked at yet
    assert tokens.accepts(f"Bearer {TOKEN_A}")
    now[0] = 6.5
    assert not tokens.accepts(f"Bearer {TOKEN_A}")
    assert tokens.accepts(f"Bearer {TOKEN_B}")


def test_no_token_reaches_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens"
    path.write_text(TOKEN_A)
    now = [0.0]
    tokens = TokenFile(path, clock=lambda: now[0])
    with caplog.at_level("DEBUG"):
        tokens.load()
        path.write_text(f"{TOKEN_A}\n{TOKEN_B}")
        now[0] = 2.0
        tokens.accepts(f"Bearer {TOKEN_B}")
        path.write_text("")
        now[0] = 4.0
        tokens.accepts("Bearer guess")
    assert "2 token(s) accepted now" in caplog.text
    assert "holds no token" in caplog.text
    for secret in (TOKEN_A, TOKEN_B, "guess"):
        assert secret not in caplog.text
