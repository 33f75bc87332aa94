"""glibc's allocator, told to keep freed memory for the next request.

A 2 MB body passes through several buffers of its size (the socket's reads, their
join, the skeleton and the long value, the upstream body). By default glibc gives
each such buffer back to the kernel when it is freed: buffers over its mmap
threshold are unmapped, and a heap top over its trim threshold is trimmed. The next
request then faults every page in again: about 1,000 page faults per 2 MB request,
2.5-3 ms of CPU on a VM, more than the router's own work on that body. With both
thresholds raised the freed buffers are reused and a steady stream of large bodies
causes no faults at all; the price is that up to ``TRIM_THRESHOLD`` of freed heap
stays with the process between bursts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): only a body this large
# gets a mapping of its own (and gives it back when freed).
MMAP_THRESHOLD = 32 << 20
# Free heap kept at its top before it is given back.
TRIM_THRESHOLD = 128 << 20
# Set by hand, glibc's own variables win: what they say is an operator's tuning.
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (``MMAP_THRESHOLD``, ``TRIM_THRESHOLD``);
    False, changing nothing, where the C library is not glibc or the environment
    already sets either threshold."""
    if any(name in os.environ for name in _ENV):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (present in glibc only: musl has a no-op mallopt)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success. The mmap threshold first: setting it also turns off
    # glibc's dynamic adjustment of both thresholds.
    ok: bool = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.warning("mallopt refused the router's heap thresholds; large bodies cost more")
    return ok
