"""An upstream request body sent as the buffers it is made of."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload

# Each write hands the socket at most this much. aiohttp (on Python < 3.12.9) joins its
# buffered headers with the first write, and asyncio copies whatever the socket did not
# take into its own buffer; a write of a whole 2 MB body costs both copies of all of
# it. In pieces, the first join is of one piece, and aiohttp waits for the socket to
# drain before the next piece once a piece was left over: at most a piece is copied.
PIECE = 256 << 10


class PartsPayload(Payload):
    """A body of several buffers (``ClientBody.upstream_parts``: a view of the client's
    bytes, the spliced tail), written in pieces of ``PIECE``, never joined."""

    _autoclose = True  # buffers in memory, nothing to close

    def __init__(self, parts: Sequence[bytes | memoryview], content_type: str) -> None:
        super().__init__(parts, content_type=content_type)
        self._parts = [memoryview(p).cast("B") for p in parts]
        self._total = sum(p.nbytes for p in self._parts)
        self._size = self._total

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._parts).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        left = self._total if content_length is None else min(content_length, self._total)
        for part in self._parts:
            for at in range(0, part.nbytes, PIECE):
                if left <= 0:
                    return
                piece = part[at : at + min(PIECE, left)]
                left -= piece.nbytes
                await writer.write(piece)

    def __repr__(self) -> str:
        return f"<PartsPayload {len(self._parts)} parts, {self._total} bytes>"


def payload(parts: Sequence[bytes | memoryview], content_type: str) -> Any:
    """``parts`` as what ``ClientSession.post(data=...)`` sends: one small buffer as
    itself (no pieces to cut), anything else as a ``PartsPayload``."""
    if len(parts) == 1 and len(parts[0]) <= PIECE and isinstance(parts[0], bytes):
        return parts[0]
    return PartsPayload(parts, content_type)
