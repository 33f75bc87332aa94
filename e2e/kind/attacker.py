"""One hostile client of a pool's router, run as a pod in the cluster (standard library
only: it runs in the operator image with ``python -c``).

For a third of ``seconds`` it sends large bodies it never finishes; then it holds as
many connections to the router's Service as it may open, half silent and half with
the largest unfinished head allowed (``max_headers`` fields of 8190 bytes). Whatever
the router closes or refuses is reopened once a second. Prints one JSON line: what it
was answered.

    python -c "$(cat attacker.py)" HOST PORT SECONDS [CONNECTIONS] [MAX_HEADERS]
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter

MIB = 1 << 20
BODY_BYTES = 48 * MIB
BODIES = 6


def worst_head(max_headers: int) -> bytes:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: pool\r\n"
    for i in range(max_headers - 1):
        name = b"X-Pad-%03d" % i
        head += name + b": " + b"v" * (8190 - len(name) - 2) + b"\r\n"
    return head


def unfinished_body() -> bytes:
    """A chat request's head and all but the last byte of its body (an inline image)."""
    pad = BODY_BYTES - 200
    body = (
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", '
        b'"image_url": {"url": "data:image/png;base64,' + b"A" * pad + b'"}}]}]}'
    )
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: pool\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    return head + body[:-1]


async def hold(host: str, port: int, opening: bytes, until: float, seen: Counter[str]) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        except (OSError, TimeoutError) as e:
            seen[f"connect:{type(e).__name__}"] += 1
            await asyncio.sleep(1)
            continue
        try:
            view = memoryview(opening)
            for k in range(0, len(view), MIB):
                w.write(view[k : k + MIB])
                await asyncio.wait_for(w.drain(), 30)
            answer = await asyncio.wait_for(r.readline(), max(0.1, until - loop.time()))
            parts = answer.split(b" ")
            seen[parts[1].decode() if len(parts) > 1 else "closed"] += 1
        except (OSError, TimeoutError) as e:
            seen[f"{type(e).__name__}"] += 1
        finally:
            w.close()
        await asyncio.sleep(1)


async def main(host: str, port: int, seconds: float, connections: int, max_headers: int) -> None:
    """A third of the time unfinished bodies alone (so each is answered, not refused for
    want of a connection), then the connection flood: one client either way."""
    seen: Counter[str] = Counter()
    loop = asyncio.get_running_loop()
    body = unfinished_body()
    until = loop.time() + seconds / 3
    await asyncio.gather(*(hold(host, port, body, until, seen) for _ in range(BODIES)))
    until = loop.time() + seconds * 2 / 3
    head = worst_head(max_headers)
    await asyncio.gather(
        *(hold(host, port, b"" if i % 2 else head, until, seen) for i in range(connections))
    )
    print(json.dumps(dict(seen)), flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(
        main(a[0], int(a[1]), float(a[2]), int(a[3]) if len(a) > 3 else 1000,
             int(a[4]) if len(a) > 4 else 32)
    )  # fmt: skip
