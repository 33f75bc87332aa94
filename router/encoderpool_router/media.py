"""Media items of an OpenAI chat request, and the per-item request a producer gets."""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from blake3 import blake3

from encoderpool_router.content import modality, url_unreadable

# Request fields that change what the encoder emits, so a producer must see them too:
# the HF processor's arguments, and how media are decoded (a video's frames: num_frames,
# fps). A producer that decoded otherwise would publish an embedding the consumer
# cannot use (other token count) and the consumer would encode the item itself.
_ENCODER_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")
# A trusted request's media kwargs, serialised, at most this long: they are a few knobs
# (num_frames, fps, max_pixels), and each producer request of the body carries them.
MM_KWARGS_BYTES = 4096
# ... and nested at most this deep. Each producer request serialises them again, deeper
# in the stack than the check here: were the recursion limit the only bound, a value
# that passed here could fail there.
MM_KWARGS_DEPTH = 16


def mm_kwargs_problem(body: dict[str, Any], trusted: bool) -> str | None:
    """Why a request's ``mm_processor_kwargs`` / ``media_io_kwargs`` are refused (a 400's
    message), or None.

    They change how much work each item costs (frames decoded, pixels encoded), so vLLM
    refuses them unless started with ``--trust-request-mm-kwargs``, by the same rule
    (any non-empty value). Refused here too, before any producer is asked, rather than
    dropped: a request quietly answered with other frames than asked for would be
    wrong. Trusted, they pass on, bounded in size and depth.
    """
    for name in _ENCODER_FIELDS:
        value = body.get(name)
        if not value:
            continue
        if not trusted:
            return (
                f"{name} is not accepted by this pool: per-request media kwargs change "
                "the encoder's cost; the pool owner enables them with "
                "spec.router.trustRequestMmKwargs (the router's --trust-request-mm-kwargs)"
            )
        if not isinstance(value, dict):
            return f"{name} must be an object"
        if _nested_past(value, MM_KWARGS_DEPTH):
            return f"{name} is nested too deeply (at most {MM_KWARGS_DEPTH} levels)"
        try:
            size = len(json.dumps(value))
        except RecursionError:  # deep past the values _nested_past walks: too big as well
            return f"{name} is nested too deeply (at most {MM_KWARGS_DEPTH} levels)"
        if size > MM_KWARGS_BYTES:
            return f"{name} is over {MM_KWARGS_BYTES} bytes serialised"
    return None


def _nested_past(value: Any, most: int) -> bool:
    """Whether ``value`` nests lists or objects more than ``most`` deep. Walked without
    recursion, and over at most ``MM_KWARGS_BYTES`` values: each serialises to a byte at
    least, so past that the size refuses it anyway."""
    todo = [(value, 1)]
    for _ in range(MM_KWARGS_BYTES):
        if not todo:
            return False
        item, depth = todo.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            if depth > most:
                return True
            todo.extend((child, depth + 1) for child in item)
    return False


def over_limits(items: list[dict[str, Any]], most: int, per_modality: dict[str, int]) -> str | None:
    """Why ``items`` (canonical parts, ``content.read_media``'s) are too many for one
    request (a 400's message), or None."""
    if len(items) > most:
        return f"{len(items)} media items in one request; at most {most} are accepted"
    counts: dict[str, int] = {}
    for part in items:
        kind = modality(part)
        counts[kind] = counts.get(kind, 0) + 1
    for kind, n in sorted(counts.items()):
        limit = per_modality.get(kind)
        if limit is not None and n > limit:
            return f"{n} {kind} items in one request; this model accepts at most {limit}"
    return None


def media_url(part: dict[str, Any]) -> str | None:
    """The URL a part names (``image_url.url`` ...), if it names one."""
    payload = part.get(str(part.get("type")))
    url = payload.get("url") if isinstance(payload, dict) else None
    return url if isinstance(url, str) else None


def _private(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global


def url_problem(
    url: str, allowed_domains: tuple[str, ...], allow_private: bool, resolve: bool = True
) -> str | None:
    """Why a media URL may not be fetched (a 400's message), or None.

    Only http(s) and inline data; only hosts of the allow-list when there is one;
    never a private, loopback or link-local address (as a literal, or as what the
    name resolves to here) unless ``allow_private``. vLLM resolves again when it
    fetches, so this is a guard, not a wall: NetworkPolicy egress is the wall.
    Never raises: what it cannot read is refused.
    """
    if unreadable := url_unreadable(url):
        return unreadable
    try:
        parts = urlsplit(url)
    except ValueError:  # "data://[": url_unreadable leaves inline data unparsed
        return "the media URL cannot be parsed"
    scheme = parts.scheme.lower()
    if scheme == "data":
        return None
    if scheme not in ("http", "https"):
        return f"media URL scheme {scheme or '(none)'!r} is refused; use http, https or data"
    host = (parts.hostname or "").lower()
    if not host:
        return "media URL has no host"
    if allowed_domains and host not in allowed_domains:
        return f"media URL host {host!r} is not among the allowed domains"
    if allow_private:
        return None
    try:
        addresses = [host] if _is_ip(host) else _resolve(host) if resolve else []
    except OSError:
        return None  # unresolvable here: vLLM's fetch fails on its own
    except ValueError:  # UnicodeError: IDNA refuses it (an empty label, one over 63 ...)
        return f"media URL host {host!r} is not a valid host name"
    if any(_private(a) for a in addresses):
        return f"media URL host {host!r} is a private, loopback or link-local address"
    return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _resolve(host: str) -> list[str]:
    return [str(info[4][0]) for info in socket.getaddrinfo(host, None)]


def media_key(
    part: dict[str, Any], utf8_of: Callable[[str], memoryview | None] | None = None
) -> bytes:
    """A digest naming the item, for producer affinity and ``--reuse-encoded-s``.

    The client's ``uuid`` when given (vLLM then uses it as the item's hash),
    else the part itself (URL or inline data): the same media sent again picks
    the same producer. It is not vLLM's ``mm_hash`` (that needs the decoded
    media), only a stable stand-in for it: a collision would cost an item a
    second encode, never a wrong answer, but clients do not trust each other, so
    the digest is still a cryptographic one. BLAKE3, not SHA-256: with AVX2 or
    AVX-512 it is 3-4x faster than SHA-256 even with SHA-NI (0.36 against 1.2 ms
    for a 2 MB image here). ``utf8_of`` (``ClientBody.utf8_of``) gives a long
    URL's UTF-8 as the client's own bytes, so it is not encoded again: the same
    key either way. A lone surrogate (``content`` refuses it before) is hashed as
    itself (``surrogatepass``), not raised on: the key is total.
    """
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        return blake3(b"uuid\0" + _utf8(uuid)).digest(16)
    payload = part.get(str(part.get("type")))
    url = payload.get("url") if isinstance(payload, dict) else None
    if isinstance(url, str):
        raw = utf8_of(url) if utf8_of is not None else None
        return blake3(raw if raw is not None else _utf8(url)).digest(16)
    data = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return blake3(data).digest(16)


def _utf8(text: str) -> bytes:
    """``text``'s UTF-8, a lone surrogate encoded as itself instead of raising: bytes no
    valid string's UTF-8 holds, so distinct strings still give distinct bytes."""
    return text.encode("utf-8", "surrogatepass")


def encoder_request(body: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """One item alone, decoding nothing: the producer encodes and publishes it."""
    req: dict[str, Any] = {
        "messages": [{"role": "user", "content": [part]}],
        "max_tokens": 1,
        "stream": False,
    }
    if "model" in body:
        req["model"] = body["model"]
    for name in _ENCODER_FIELDS:
        if name in body:
            req[name] = body[name]
    return req


def encoder_request_bytes(
    body: dict[str, Any],
    part: dict[str, Any],
    literal: Callable[[str], memoryview | None] | None = None,
) -> bytes:
    """``encoder_request`` serialised. A long media URL (a data: URL of a large image)
    is not serialised again: ``literal`` finds its JSON literal in the client's bytes
    (``ClientBody.literal``) and that is copied in, once."""
    parts = encoder_request_parts(body, part, literal)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def encoder_request_parts(
    body: dict[str, Any],
    part: dict[str, Any],
    literal: Callable[[str], memoryview | None] | None = None,
) -> tuple[bytes] | tuple[bytes, memoryview, bytes]:
    """``encoder_request_bytes`` unjoined: with a literal found, the serialised head,
    the literal (a view of the client's bytes) and the tail, sent as they are."""
    req = encoder_request(body, part)
    url = media_url(part)
    found = literal(url) if literal is not None and url is not None else None
    if found is None:
        return (json.dumps(req).encode(),)
    kind = str(part["type"])
    marker = "\u0000encoderpool-url\u0000"
    stub = {**part, kind: {**part[kind], "url": marker}}
    text = json.dumps({**req, "messages": [{"role": "user", "content": [stub]}]}).encode()
    quoted = json.dumps(marker).encode()
    if text.count(quoted) != 1:  # the marker spelled elsewhere too (a client's key or value)
        return (json.dumps(req).encode(),)
    head, _, tail = text.partition(quoted)
    return head, found, tail
