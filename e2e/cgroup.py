"""A memory limit on one process, as a container's: a cgroup of its own.

A pod's memory limit is a cgroup's; past it the kernel kills the process. Tests that
must show a process stays within its limit put it in a child cgroup of the test's own
(cgroup v2: ``memory.max``; v1: ``memory.limit_in_bytes``), so breaking the limit
ends the same way it would in a pod. Where no cgroup can be written (not root, a
read-only hierarchy), ``RLIMIT_AS`` is the stand-in: allocations past it fail instead.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")


def _own_group() -> tuple[Path, str] | None:
    """This process's memory cgroup directory and the name of its limit file."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and (_ROOT / "cgroup.controllers").exists():  # v2
            return _ROOT / path.lstrip("/"), "memory.max"
        if "memory" in controllers.split(","):  # v1
            return _ROOT / "memory" / path.lstrip("/"), "memory.limit_in_bytes"
    return None


@contextlib.contextmanager
def memory_limited(pid: int, limit_bytes: int, name: str) -> Iterator[str]:
    """``pid`` in a new cgroup limited to ``limit_bytes`` for the block; yields how the
    limit is applied (``cgroup v1|v2 <dir>`` or ``RLIMIT_AS``). The group is removed
    afterwards (the process, if alive, moved back)."""
    own = _own_group()
    group = own[0] / f"{name}-{os.getpid()}" if own else None
    try:
        assert group is not None
        assert own is not None
        group.mkdir()
        (group / own[1]).write_text(str(limit_bytes))
        (group / "cgroup.procs").write_text(str(pid))
    except (AssertionError, OSError):
        if group is not None:
            with contextlib.suppress(OSError):
                group.rmdir()
        resource.prlimit(pid, resource.RLIMIT_AS, (limit_bytes, limit_bytes))
        yield "RLIMIT_AS"
        return
    try:
        yield f"cgroup {own[1]} {group}"
    finally:
        with contextlib.suppress(OSError):
            (own[0] / "cgroup.procs").write_text(str(pid))
        for _ in range(50):  # removable once its last process left
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def rss_bytes(pid: int) -> int:
    """The process's resident memory (VmRSS), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
