"""What a 2 MB body's passes over memory cost on this machine, alone, in one process.

``router_load.py`` reports the router's CPU per 2 MB request under load (4-5 ms on
the 2-core VM of docs/benchmarks-router.md). This prints the floor under it: each
O(size) pass the router makes over such a body, timed alone with warm caches (the
body the router receives as 256 KiB chunks, their join, the long value's UTF-8
decode, its BLAKE3 media key, and one send + receive of the body over loopback TCP,
as to the consumer). Their sum is what the router would cost if nothing else ran;
the gap to the loaded figure is the cache misses of 50 bodies in flight (100 MB,
beyond any cache) and the HTTP stack.

    python benchmarks/router_floor.py [--mb 2] [--reps 200]

Last line: ``RESULT floor_ms=<sum of the passes' medians>``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import socket
import statistics
import time
from collections.abc import Callable

from blake3 import blake3

from encoderpool_router.heap import keep_freed_memory

CHUNK = 256 << 10  # what asyncio's selector transport reads at a time


def median_ms(f: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def loopback_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    return client, peer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=2.0, help="base64 image size, MB")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    keep_freed_memory()  # as the router does at start-up

    b64 = base64.b64encode(os.urandom(int(args.mb * 1e6 * 3 / 4)))
    head = b'{"model":"m","messages":[{"role":"user","content":[{"type":"image_url",'
    head += b'"image_url":{"url":"data:image/png;base64,'
    body = head + b64 + b'"}}]}]}'
    value = memoryview(body)[len(head) - len("data:image/png;base64,") : len(head) + len(b64)]
    chunks = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)]

    sender, receiver = loopback_pair()
    sender.setblocking(False)
    receiver.setblocking(False)

    def send_and_receive() -> None:
        """One thread, both ends non-blocking: no thread switch is timed, only the copies."""
        sent = got = 0
        view = memoryview(body)
        while got < len(body):
            if sent < len(body):
                with contextlib.suppress(BlockingIOError):
                    sent += sender.send(view[sent : sent + CHUNK])
            with contextlib.suppress(BlockingIOError):
                got += len(receiver.recv(CHUNK))

    passes = {
        "the HTTP parser's chunk copies": lambda: [
            body[i : i + CHUNK] for i in range(0, len(body), CHUNK)
        ],
        "join the chunks": lambda: b"".join(chunks),
        "decode the long value": lambda: str(value, "utf-8"),
        "BLAKE3 media key": lambda: blake3(value).digest(16),
        "loopback TCP send + receive": send_and_receive,  # the router's two kernel copies
    }
    try:
        figures = {name: median_ms(f, args.reps) for name, f in passes.items()}
    finally:
        sender.close()
        receiver.close()
    print(f"body {len(body)} bytes, median of {args.reps} each, warm caches, one process")
    for name, ms in figures.items():
        print(f"  {name:<30} {ms:7.3f} ms")
    print(f"RESULT floor_ms={sum(figures.values()):.2f}")


if __name__ == "__main__":
    main()
