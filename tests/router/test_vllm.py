"""The router in front of real vLLM: a producer and a consumer with our EC connector
(``fixtures_router.EC_CONNECTOR``), compared with a monolithic server. Producer and
consumer hold the pool's API key, as the operator deploys them: requests that did not
come through the router are refused, and the router's own client tokens are checked.

"The consumer did not encode" is read from the servers' DEBUG logs: the model
runner logs ``Finish execute for mm hash X`` each time a process runs its
encoder. The servers are shared by the package (tests/router/conftest.py); the
producer-kill test stops the producer, so it runs after the package's other tests.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from e2e.media import MODEL, chat_request, data_url, image, token_ids
from e2e.vllm_server import post_json
from tests.router.fixtures import API_KEY, Epd, RouterProcess, encoded_hashes
from tests.waiting import wait_until

pytestmark = pytest.mark.vllm
CHAT = "/v1/chat/completions"


def stream_token_ids(url: str, body: dict[str, Any]) -> tuple[list[int], int]:
    """Token ids of a streamed chat answer, and how many SSE events carried them."""
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    ids: list[int] = []
    events = 0
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for choice in chunk.get("choices", []):
                if choice.get("token_ids"):
                    ids += choice["token_ids"]
                    events += 1
    return ids, events


def encoder_runs(epd: Epd) -> Callable[[], tuple[set[str], set[str]]]:
    """A probe of the hashes producer and consumer have encoded so far."""
    return lambda: (
        encoded_hashes(epd.producer.log_text()),
        encoded_hashes(epd.consumer.log_text()),
    )


@pytest.mark.parametrize(
    ("n_images", "stream", "first"),
    [(1, False, 100), (2, False, 110), (1, True, 120), (2, True, 130)],
)
def test_chat_through_the_router_matches_monolithic_and_the_consumer_does_not_encode(
    epd: Epd, n_images: int, stream: bool, first: int
) -> None:
    images = [image(first + i) for i in range(n_images)]
    expected = token_ids(epd.mono.chat(chat_request(*images)))
    probe = encoder_runs(epd)
    produced_before, consumed_before = probe()
    remote_before = epd.router.metric("encoderpool_router_media_items_total", encoded="remote")

    if stream:
        got, events = stream_token_ids(epd.router.url, chat_request(*images, stream=True))
        assert events > 1  # token by token, not one blob
    else:
        got = token_ids(post_json(epd.router.url + "/v1/chat/completions", chat_request(*images)))

    assert got == expected
    produced, consumed = probe()
    assert len(produced - produced_before) == n_images  # each item encoded by the producer
    assert consumed == consumed_before  # and never by the consumer
    remote = epd.router.metric("encoderpool_router_media_items_total", encoded="remote")
    assert remote - remote_before == n_images


def test_fifty_concurrent_requests_get_correct_answers(epd: Epd) -> None:
    images = {i: image(200 + i) for i in range(10)}
    expected = {i: token_ids(epd.mono.chat(chat_request(png))) for i, png in images.items()}
    probe = encoder_runs(epd)
    produced_before, consumed_before = probe()
    jobs = [i % 10 for i in range(50)]

    def one(i: int) -> list[int]:
        return token_ids(
            post_json(epd.router.url + "/v1/chat/completions", chat_request(images[i]))
        )

    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(one, jobs))
    assert results == [expected[i] for i in jobs]
    produced, consumed = probe()
    assert len(produced - produced_before) == 10
    assert consumed == consumed_before


def typeless(png: bytes, uuid: str) -> dict[str, Any]:
    """A content part without ``type``, as vLLM's chat parser also accepts it."""
    return {"image_url": data_url(png), "uuid": uuid}


def test_a_typeless_part_with_another_client_s_uuid_is_answered_about_its_own_image(
    epd: Epd,
) -> None:
    """Client A sends image X as a type-less part with uuid U; client B sends image Y
    with the same U. vLLM keys an item by its uuid, so had the router passed the part
    on unexamined, B would be answered about X. Each is answered as the monolithic
    server answers its own image, and the consumer encodes nothing."""
    x, y = image(600), image(601)
    want_x = token_ids(epd.mono.chat(chat_request(x)))
    want_y = token_ids(epd.mono.chat(chat_request(y)))
    assert want_x != want_y  # else the test could not tell the two apart
    probe = encoder_runs(epd)
    _, consumed_before = probe()
    answers = []
    for png in (x, y):
        body = chat_request(png)
        body["messages"][0]["content"][0] = typeless(png, "shared-by-a-and-b")
        answers.append(token_ids(post_json(epd.router.url + "/v1/chat/completions", body)))
    assert answers == [want_x, want_y]
    assert probe()[1] == consumed_before


def test_every_spelling_of_an_image_is_answered_as_the_monolithic_server_answers_it(
    epd: Epd,
) -> None:
    png = image(602)
    want = token_ids(epd.mono.chat(chat_request(png)))
    spellings = [
        {"image_url": data_url(png)},
        {"type": "input_image", "image_url": data_url(png), "detail": "auto"},
        {"image_url": {"url": data_url(png)}, "uuid": "anything"},
    ]
    for part in spellings:
        body = chat_request(png)
        body["messages"][0]["content"][0] = part
        assert token_ids(post_json(epd.router.url + "/v1/chat/completions", body)) == want, part


def test_a_part_the_router_cannot_read_is_a_400_naming_it_and_never_forwarded(epd: Epd) -> None:
    body = chat_request(image(603))
    body["messages"][0]["content"].append({"type": "image_embeds", "image_embeds": "AAAA"})
    before = epd.router.metric("encoderpool_router_requests_total", endpoint=CHAT, code="400")
    req = urllib.request.Request(
        epd.router.url + CHAT,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=60)
    assert refused.value.code == 400
    assert "messages[0].content[2]" in json.loads(refused.value.read())["error"]["message"]
    after = epd.router.metric("encoderpool_router_requests_total", endpoint=CHAT, code="400")
    assert after == before + 1


def status_of(
    url: str, body: dict[str, Any] | None = None, token: str | None = None, method: str = "POST"
) -> int:
    """The HTTP status of one request (a GET without ``body``), with an optional bearer token."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_producers_and_consumers_refuse_requests_that_did_not_come_through_the_router(
    epd: Epd,
) -> None:
    body = chat_request(image(400))
    expected = token_ids(epd.mono.chat(body))
    tokenize = {"model": MODEL, "prompt": "hello"}
    # /invocations (SageMaker's entry point) runs chat completions, and vLLM's own key
    # check guards only /v1 and a few other prefixes: on a server without the guard it
    # answers anyone (the monolithic reference server holds no key).
    assert status_of(epd.mono.url + "/invocations", body) == 200
    for server in (epd.producer, epd.consumer):
        for token in (None, "wrong-key", API_KEY + "x", API_KEY[:-1]):
            for path, req in [
                ("/v1/chat/completions", body),
                ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
                ("/invocations", body),
                ("/tokenize", tokenize),
            ]:
                assert status_of(server.url + path, req, token) == 401, (server.name, path)
            assert status_of(server.url + "/v1/models", token=token, method="GET") == 401
        # Open, by design: the kubelet's probe and the scrapers (no request data behind them).
        assert status_of(server.url + "/health", method="GET") == 200
        assert status_of(server.url + "/metrics", method="GET") == 200
        assert status_of(server.url + "/v1/models", token=API_KEY, method="GET") == 200

    # The honest path: through the router, which holds the key.
    got = token_ids(post_json(epd.router.url + "/v1/chat/completions", body))
    assert got == expected
    assert API_KEY not in epd.router.log_text()


def test_client_tokens_at_the_router_in_front_of_real_vllm(epd: Epd, tmp_path: Path) -> None:
    one, two = "client-one-" + "1" * 32, "client-two-" + "2" * 32
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{one}\n{two}\n")
    body = chat_request(image(410))
    expected = token_ids(epd.mono.chat(body))
    router = RouterProcess(
        ["--producers", epd.producer.url, "--consumers", epd.consumer.url,
         "--auth-token-file", str(tokens), "--log-level", "DEBUG"],
        tmp_path / "router.log",
        env={"ENCODERPOOL_ROUTER_BACKEND_API_KEY": API_KEY},
    )  # fmt: skip
    chat = router.url + "/v1/chat/completions"
    try:
        router.start()  # it waits on /health, which needs no token
        for token in (None, "wrong", API_KEY):  # the pods' key is not a client token
            assert status_of(chat, body, token) == 401, token
        assert status_of(router.url + "/v1/models", token=None, method="GET") == 401
        for token in (one, two):  # either token: rotation keeps both for a while
            answer = post_json(chat, body, headers={"Authorization": f"Bearer {token}"})
            assert token_ids(answer) == expected
        tokens.write_text(f"{two}\n")  # revoke the first; no restart
        wait_until("the revoked token to be refused", lambda: status_of(chat, body, one) == 401)
        assert status_of(chat, body, two) == 200
        log = router.log_text()
        assert "client token file" in log  # the change was noticed ...
        for secret in (one, two, API_KEY):
            assert secret not in log  # ... and no token was logged
    finally:
        router.stop()


def test_a_client_at_its_share_gets_429_while_another_is_answered_as_monolithic(
    epd: Epd, tmp_path: Path
) -> None:
    """Client A holds its one request slot with a body it never finishes sending; its
    next request is a 429 at once, client B's is answered with the monolithic server's
    tokens, and A's dribbling request ends in a 408 that frees the slot."""
    a, b = "client-a-" + "a" * 32, "client-b-" + "b" * 32
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{a}\n{b}\n")
    body = chat_request(image(411))
    expected = token_ids(epd.mono.chat(body))
    router = RouterProcess(
        ["--producers", epd.producer.url, "--consumers", epd.consumer.url,
         "--auth-token-file", str(tokens), "--max-requests-per-client", "1",
         "--body-read-timeout-s", "5"],
        tmp_path / "router.log",
        env={"ENCODERPOOL_ROUTER_BACKEND_API_KEY": API_KEY},
    )  # fmt: skip
    chat = router.url + CHAT
    try:
        router.start()
        host, port = router.url.removeprefix("http://").split(":")
        held = socket.create_connection((host, int(port)), timeout=30)
        held.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {a}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
        )
        wait_until("A's slot taken", lambda: status_of(chat, body, a) == 429)
        answer = post_json(chat, body, headers={"Authorization": f"Bearer {b}"})
        assert token_ids(answer) == expected
        assert held.recv(64).startswith(b"HTTP/1.1 408")  # after --body-read-timeout-s
        held.close()
        assert status_of(chat, body, a) == 200  # the slot is free again
    finally:
        router.stop()


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of a server's /metrics (the volume's gauges have no labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            samples[name] = float(value)
    return samples


def test_vllm_servers_report_the_cache_volume_s_space_and_files(epd: Epd) -> None:
    """The middleware the operator adds to shared-volume pods, loaded by vLLM itself."""
    for server in (epd.producer, epd.consumer):
        st = os.statvfs(epd.store)
        got = scrape(server.url)
        assert got["encoderpool_ec_volume_size_bytes"] == st.f_blocks * st.f_frsize
        assert got["encoderpool_ec_volume_files"] == st.f_files
        # Free space moves with whatever else writes on this disk: near, not equal.
        free = st.f_bavail * st.f_frsize
        assert abs(got["encoderpool_ec_volume_available_bytes"] - free) < 0.05 * free + 2**26
        assert 0 < got["encoderpool_ec_volume_files_available"] <= st.f_files


@pytest.mark.breaks_shared_servers
def test_a_killed_producer_leaves_encoding_to_the_consumer(epd: Epd) -> None:
    """Last in the package: it stops the shared producer."""
    images = [image(300 + i) for i in range(6)]
    expected = [token_ids(epd.mono.chat(chat_request(png))) for png in images]
    probe = encoder_runs(epd)
    _, consumed_before = probe()
    local_before = epd.router.metric("encoderpool_router_media_items_total", encoded="local")
    got = []
    for i, png in enumerate(images):
        if i == 2:
            epd.producer.stop()
        got.append(token_ids(post_json(epd.router.url + "/v1/chat/completions", chat_request(png))))
    assert got == expected
    _, consumed = probe()
    assert len(consumed - consumed_before) == 4  # the consumer encoded the items after the kill
    local = epd.router.metric("encoderpool_router_media_items_total", encoded="local")
    assert local - local_before == 4
    assert epd.router.metric("encoderpool_router_errors_total", kind="producer_error") >= 1
