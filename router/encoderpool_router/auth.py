"""Client authentication at the router: bearer tokens from a file, followed as it changes.

The file is a key of a Secret the pool's owner makes, mounted as a volume: one
token per line, so a new token can be rolled in beside the old one and the old
one removed later. Kubernetes replaces a mounted Secret's files when the Secret
changes (a new file behind the same path), so the router looks at the file's
identity at most once per ``recheck_s`` and reads it again when it changed: a
rotation takes effect within the kubelet's sync period plus a second, with no
restart. Tokens are kept as SHA-256 digests and compared in constant time; no
token (nor a digest) is ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

BEARER = "bearer"


def parse_tokens(text: str) -> tuple[str, ...]:
    """One token per line; blank lines and surrounding whitespace ignored."""
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != BEARER or not token:
        return None
    return token


def _digest(token: str) -> bytes:
    return hashlib.sha256(client_bytes(token)).digest()


def client_bytes(text: str) -> bytes:
    """A header value's bytes as the client sent them: aiohttp decodes headers with
    ``surrogateescape``, so bytes that are not UTF-8 come back as they were (a token
    that matches nothing) instead of failing the request."""
    return text.encode("utf-8", "surrogateescape")


class TokenFile:
    """The accepted client tokens, read from ``path`` and re-read when the file changes.

    A file that cannot be read at start is a start-up error (``load`` raises
    ValueError). Later, a read that fails (the kubelet swapping the files) keeps
    the tokens last read and tries again at the next check; a file that holds no
    token refuses every request (fail closed) and says so once.
    """

    def __init__(
        self,
        path: Path,
        recheck_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.recheck_s = recheck_s
        self._clock = clock
        self._digests: tuple[bytes, ...] = ()
        self._identity: tuple[int, int, int, int] | None = None
        self._checked = float("-inf")
        self.reloads = 0  # times the tokens were (re)read, for tests and logs

    def load(self) -> None:
        """Read the file now; ValueError (naming the file, never its content) if unreadable."""
        try:
            self._read()
        except OSError as e:
            raise ValueError(f"cannot read the client token file {self.path}: {e}") from None
        if not self._digests:
            raise ValueError(
                f"the client token file {self.path} holds no token (one per line expected)"
            )

    def _read(self) -> None:
        st = os.stat(self.path)
        text = self.path.read_text(encoding="utf-8", errors="replace")
        self._identity = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        self._digests = tuple(_digest(t) for t in parse_tokens(text))
        self.reloads += 1
        if self.reloads > 1:
            logger.info(
                "client token file %s changed: %d token(s) accepted now",
                self.path,
                len(self._digests),
            )
        if not self._digests:
            logger.warning(
                "client token file %s holds no token: every request is refused", self.path
            )

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._checked < self.recheck_s:
            return
        self._checked = now
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size) != self._identity:
                self._read()
        except OSError as e:
            logger.warning(
                "client token file %s: %s; keeping the %d token(s) read before",
                self.path,
                e.strerror or e,
                len(self._digests),
            )

    def accepts(self, header: str | None) -> bool:
        """Does an ``Authorization`` header carry one of the tokens? Constant time per token."""
        self._refresh()
        token = bearer_token(header)
        if token is None:
            return False
        presented = _digest(token)
        ok = False
        for digest in self._digests:  # no early exit: the time does not say which one matched
            ok |= hmac.compare_digest(presented, digest)
        return ok
