"""The shared cache volume's filesystem on the vLLM server's own /metrics.

A full cache volume makes every save fail, and each of those items then costs a consumer
its own encode. The volume can fill past the pool's capacity bound from outside it (other
pools on the same claim, a capacity set above the volume's size, files of another
tenant), and the kubelet's volume statistics cover only some volume plugins, so the pod
reports the filesystem itself. It is measured at scrape time: one ``statvfs``, no walk of
the directory, whatever the volume holds.

vLLM gives no hook into its API server process but ``--middleware``, so this is one: it
passes every request on untouched and registers the gauges when the app is built. The
operator loads it with the contracts' ``VOLUME_METRICS_MIDDLEWARE`` and sets
``CACHE_DIR_ENV``; it depends on the standard library, prometheus_client and the
contracts only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from encoderpool_contracts.metrics import (
    EC_VOLUME_AVAILABLE_BYTES,
    EC_VOLUME_FILES,
    EC_VOLUME_FILES_AVAILABLE,
    EC_VOLUME_SIZE_BYTES,
)
from encoderpool_contracts.pod import CACHE_DIR_ENV, VOLUME_METRICS_MIDDLEWARE

logger = logging.getLogger("vllm." + __name__)

# (name, help), in the order ``VolumeCollector`` reads them from statvfs.
GAUGES = (
    (EC_VOLUME_SIZE_BYTES, "Size of the cache volume's filesystem."),
    (
        EC_VOLUME_AVAILABLE_BYTES,
        "Bytes an unprivileged writer (this pod) can still write on the cache volume.",
    ),
    (EC_VOLUME_FILES, "Files (inodes) the cache volume's filesystem has."),
    (
        EC_VOLUME_FILES_AVAILABLE,
        "Files (inodes) an unprivileged writer can still create on the cache volume "
        "(each entry is a file).",
    ),
)


class VolumeCollector(Collector):
    """The four gauges of ``GAUGES``, read from ``statvfs(path)`` at each scrape; none
    when the volume cannot be read (the scrape itself never fails)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            st = os.statvfs(self.path)
        except OSError as e:
            logger.warning("cache volume %s unreadable for its metrics: %s", self.path, e)
            return
        values = (
            st.f_blocks * st.f_frsize,  # blocks are counted in fragments
            st.f_bavail * st.f_frsize,
            st.f_files,
            st.f_favail,
        )
        for (name, doc), value in zip(GAUGES, values, strict=True):
            yield GaugeMetricFamily(name, doc, value=value)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # values are only read at scrape time


_registered: dict[str, VolumeCollector] = {}


def register(path: str) -> VolumeCollector:
    """Register the collector for ``path`` once per process (vLLM builds one app)."""
    found = _registered.get(path)
    if found is None:
        found = _registered[path] = VolumeCollector(path)
        REGISTRY.register(found)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # vLLM then serves a registry of its own per scrape, without this process's.
            logger.warning(
                "PROMETHEUS_MULTIPROC_DIR is set (several API servers): the cache volume's "
                "gauges are not exported; watch the volume another way"
            )
    return found


class VolumeMetrics:
    """Pass-through ASGI middleware whose construction registers the volume's gauges."""

    def __init__(self, app: Any) -> None:
        path = os.environ.get(CACHE_DIR_ENV, "")
        if not path:
            raise RuntimeError(
                f"{CACHE_DIR_ENV} is empty: {VOLUME_METRICS_MIDDLEWARE} needs the cache "
                "volume's mount path (the operator sets it in shared-volume pools)"
            )
        self.app = app
        register(path)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)
