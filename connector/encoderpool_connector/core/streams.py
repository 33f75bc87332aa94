"""Copies between host and a CUDA device on a side stream, never waited for on the step.

``SaveCopies`` (device to host, saves): the copy is ordered after the encoder's
work by an event recorded on the current stream, runs on a copy stream of its
own, and returns an event the writer thread waits on. The source's memory is
marked as used by the copy stream (``record_stream``), so the caching allocator
does not hand it out again before the copy read it, even if vLLM drops the
output first.

``DeviceUploads`` (host to device, loads): the copy of one payload runs on a
side stream while the loading thread reads the next; the current stream waits
for it on the device (no host wait), so the model sees the bytes. The host
buffer (a pinned slot of the load pool) is held until the copy's event reports
done, so the slot is not reused under a running copy.

Only CUDA (and ROCm, which torch also calls ``cuda``) takes these paths; callers
check the device type first.
"""

from __future__ import annotations

import collections
from typing import Any

import torch


class SaveCopies:
    """Device-to-host copies of encoder outputs on one copy stream per device."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream

    def start(self, host: torch.Tensor, src: torch.Tensor) -> Any:
        """Queue ``host.copy_(src)`` after the work queued so far on ``src``'s current
        stream; the event to wait on (``synchronize``) before reading ``host``.

        Nothing here waits on the host or allocates host memory. A failure before the
        copy is queued raises with nothing queued (the caller may reuse ``host``); see
        ``CopyQueued`` for one after."""
        stream = self._stream(src.device)
        encoded = torch.cuda.Event()
        encoded.record(torch.cuda.current_stream(src.device))
        stream.wait_event(encoded)
        # Before the copy: from here on the allocator keeps src's block until the copy
        # stream passed this point, whoever frees the tensor.
        src.record_stream(stream)
        # Blocking: the writer thread sleeps in synchronize() instead of spinning a core.
        done = torch.cuda.Event(blocking=True)
        try:
            with torch.cuda.stream(stream):
                host.copy_(src, non_blocking=True)
                done.record(stream)
        except Exception as e:
            raise CopyQueued(e) from e
        return done


class CopyQueued(RuntimeError):
    """A copy may have been queued before this failure: its destination must not be
    reused (the caller keeps it lent rather than risk a copy writing into a reuse)."""


class DeviceUploads:
    """Host-to-device copies on a side stream; host buffers held until their copy ran."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._in_flight: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()

    def start(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the device, usable by work queued on the current stream from now
        on (it waits for the copy on the device). ``host`` stays referenced until the
        copy is done, so its buffer is not reused under it."""
        self.reap()
        current = torch.cuda.current_stream(self.device)
        # Allocated in the current stream's pool, as vLLM's own tensors: its block may
        # have been freed by work still queued there, so the copy waits for that work.
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self.stream.wait_stream(current)
        done = torch.cuda.Event()
        try:
            with torch.cuda.stream(self.stream):
                out.copy_(host, non_blocking=True)
                done.record(self.stream)
        except Exception:
            # A copy may be queued with no event to tell when it ran: wait for it here
            # (a failure path only), so the caller may reuse ``host``.
            self.stream.synchronize()
            raise
        self._in_flight.append((done, host))
        current.wait_event(done)
        return out

    def reap(self) -> None:
        """Drop the host buffers whose copies are done (one stream: they finish in order)."""
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
