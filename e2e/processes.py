"""Start a command in its own process group and stop that group by our PID.

Every local process the tests, the demo and the benchmarks start goes through
here, so "stop what you started, by PID, never by name" holds in one place:
vLLM's API server, engine core and workers, kopf, the control plane, all go
with their group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def start_group(
    argv: Sequence[str], env: Mapping[str, str], log_path: Path
) -> subprocess.Popen[bytes]:
    """Run ``argv`` with stdout and stderr appended to ``log_path``, in a new session."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            list(argv),
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 20.0, kill: bool = False) -> None:
    """SIGTERM (SIGKILL with ``kill``) the group, wait, then SIGKILL whatever is left."""
    stop_groups([proc], timeout, kill)


def stop_groups(
    procs: Sequence[subprocess.Popen[bytes]], timeout: float = 20.0, kill: bool = False
) -> None:
    """``stop_group`` for several groups at once: all are signalled before any is
    awaited, so their shutdowns overlap (a vLLM server takes seconds to drain)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (e.g. vLLM workers)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def wait_healthy(
    proc: subprocess.Popen[bytes], url: str, what: str, log_path: Path, timeout: float
) -> None:
    """Until ``url`` answers 200; fail fast, with the log's tail, if the process exits."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with {proc.returncode}; log {log_path}:\n{log_tail(log_path)}"
            )
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(
        f"{what} not healthy after {timeout:.0f}s; log {log_path}:\n{log_tail(log_path)}"
    )


def log_tail(log_path: Path, lines: int = 80) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so ``finally`` and context managers stop what we started."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
