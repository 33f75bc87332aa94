"""Which media URLs the router lets a producer or consumer fetch: the guard in front of
vLLM's own fetch (NetworkPolicy egress is the wall)."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from encoderpool_router.content import url_unreadable


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
