"""A stand-in for a vLLM producer or consumer, for measuring the router's own cost.

It speaks just enough HTTP/1.1 (keep-alive, Content-Length bodies) on a raw
asyncio protocol, so that its own cost per request is small and the same
whether a request came straight from the load generator or through the router.
Answers have vLLM's shape: a consumer answers a chat completion (JSON, or SSE
with one event per token when the body asks for ``"stream": true``), a
producer a one-token completion carrying ``ec_transfer_params`` with one item
and our announcement.

Service time: a consumer waits the milliseconds the request names in its
``user`` field (``"user": "stub-delay-ms=<ms>"``; the router passes the body
on unchanged), so the same request takes the same backend time on either path
and a run can compare the two request by request. A producer waits
``--producer-ms``. The answer says whether the request carried
``ec_transfer_params`` (``"ec_params_seen"``), so the load generator can check
what the router did.

    python -m benchmarks.router_stub --role consumer --port 8100 [--producer-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import zlib

CHAT_PATH = b"/v1/chat/completions"
DELAY_TAG = b'"stub-delay-ms='
PARAMS_TAG = b'"ec_transfer_params"'
FINGERPRINT = "0123456789abcdef"


def delay_hint(body: bytes) -> float:
    """The service time the request asks for, in seconds (0 when it names none)."""
    at = body.rfind(DELAY_TAG)
    if at < 0:
        return 0.0
    start = at + len(DELAY_TAG)
    end = body.find(b'"', start, start + 32)
    return float(body[start:end]) / 1e3 if end > 0 else 0.0


def _tokens(body: bytes) -> int:
    at = body.rfind(b'"max_tokens"')
    if at < 0:
        return 16
    digits = body[at + 12 : at + 32].lstrip(b": ")
    n = 0
    for c in digits:
        if not 48 <= c <= 57:
            break
        n = n * 10 + c - 48
    return max(1, n)


def consumer_answer(tokens: int, params_seen: bool) -> bytes:
    """A non-streaming chat completion as vLLM 0.32 writes it (token ids requested)."""
    return json.dumps(
        {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "stub",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": " word" * tokens,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "token_ids": list(range(100, 100 + tokens)),
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": 40,
                "total_tokens": 40 + tokens,
                "completion_tokens": tokens,
                "prompt_tokens_details": None,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "kv_transfer_params": None,
            "ec_params_seen": params_seen,
        }
    ).encode()


def consumer_events(tokens: int, params_seen: bool) -> list[bytes]:
    """The SSE events of a streamed chat completion, one token each, then [DONE]."""
    events = []
    for i in range(tokens):
        chunk = {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": "stub",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": " word"},
                    "logprobs": None,
                    "finish_reason": "length" if i == tokens - 1 else None,
                    "token_ids": [100 + i],
                }
            ],
            "ec_params_seen": params_seen,
        }
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def producer_answer(body: bytes) -> bytes:
    """A one-token completion with one item's params (its hash: a checksum of the body)."""
    mm_hash = f"{zlib.crc32(body[-4096:]) ^ len(body):016x}"
    item = {"num_encoder_tokens": 16, "encoderpool": {"v": 1, "fingerprint": FINGERPRINT}}
    return json.dumps(
        {
            "id": "chatcmpl-stub-enc",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "stub",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "", "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
            ],
            "usage": {"prompt_tokens": 40, "total_tokens": 41, "completion_tokens": 1},
            "kv_transfer_params": None,
            "ec_transfer_params": {mm_hash: item},
        }
    ).encode()


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type
        + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip


class Stub(asyncio.Protocol):
    """One client connection: requests one at a time, answered after their service time."""

    def __init__(self, role: str, producer_s: float) -> None:
        self.role = role
        self.producer_s = producer_s
        self.buf = bytearray()
        self.head: tuple[bytes, bytes] | None = None
        self.need = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.head is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                lines = bytes(self.buf[:end]).split(b"\r\n")
                del self.buf[: end + 4]
                method, path, _ = lines[0].split(b" ", 2)
                self.need = 0
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        self.need = int(value)
                self.head = (method, path)
            if len(self.buf) < self.need:
                return
            body = bytes(self.buf[: self.need])
            del self.buf[: self.need]
            method, path = self.head
            self.head = None
            self.handle(method, path, body)

    def handle(self, method: bytes, path: bytes, body: bytes) -> None:
        loop = asyncio.get_running_loop()
        if method == b"GET":
            listing = b'{"object": "list", "data": []}'
            self._send(_response("200 OK", b'{"status": "ok"}' if path == b"/health" else listing))
            return
        if method != b"POST" or path.split(b"?")[0] != CHAT_PATH:
            self._send(_response("404 Not Found", b'{"error": "not found"}'))
            return
        if self.role == "producer":
            loop.call_later(self.producer_s, self._send, _response("200 OK", producer_answer(body)))
            return
        tokens, seen = _tokens(body), body.rfind(PARAMS_TAG) >= 0
        if b'"stream": true' in body[-512:] or b'"stream":true' in body[-512:]:
            loop.call_later(delay_hint(body), self._stream, consumer_events(tokens, seen))
        else:
            answer = _response("200 OK", consumer_answer(tokens, seen))
            loop.call_later(delay_hint(body), self._send, answer)

    def _send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _stream(self, events: list[bytes]) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
        parts = [head + b"\r\n\r\n"]
        for e in events:
            parts.append(f"{len(e):x}\r\n".encode() + e + b"\r\n")
        parts.append(b"0\r\n\r\n")
        self._send(b"".join(parts))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve(role: str, host: str, port: int, producer_s: float) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Stub(role, producer_s), host, port, backlog=512)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["producer", "consumer"], required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--producer-ms", type=float, default=0.0, help="a producer's service time")
    args = ap.parse_args()
    assert args.host == "127.0.0.1", "loopback only"
    asyncio.run(serve(args.role, args.host, args.port, args.producer_ms / 1e3))


if __name__ == "__main__":
    main()
