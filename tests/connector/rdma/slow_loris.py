"""A slow-loris client for the side channel's tests: connections that never finish a frame."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable


def slow_loris(
    port: int, limit_s: float, meanwhile: Callable[[float], None], count: int = 10
) -> list[float]:
    """``count`` connections from 127.0.0.2, each a frame header promising 4000 bytes and
    then a byte every 0.1 s; ``meanwhile(elapsed)`` runs each round. Returns when each
    was closed (seconds from the start, sorted); gives up after ``limit_s``."""
    conns = [
        socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
        for _ in range(count)
    ]
    closed_at: dict[int, float] = {}
    t0 = time.monotonic()
    try:
        for s in conns:
            s.sendall(struct.pack(">I", 4000))
            s.setblocking(False)
        while len(closed_at) < len(conns) and time.monotonic() - t0 < limit_s:
            for i, s in enumerate(conns):
                if i in closed_at:
                    continue
                try:
                    s.send(b" ")
                    if s.recv(4096) == b"":
                        closed_at[i] = time.monotonic() - t0
                except BlockingIOError:
                    pass
                except OSError:
                    closed_at[i] = time.monotonic() - t0
            meanwhile(time.monotonic() - t0)
            time.sleep(0.1)
    finally:
        for s in conns:
            s.close()
    return sorted(closed_at.values())
