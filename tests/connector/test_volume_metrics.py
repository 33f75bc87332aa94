"""The cache volume's gauges, as plain ASGI and a registry (tests/router/test_vllm.py
scrapes them from real vLLM servers)."""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from encoderpool_connector.programs import volume_metrics
from encoderpool_connector.programs.volume_metrics import GAUGES, VolumeCollector, VolumeMetrics
from encoderpool_contracts.pod import CACHE_DIR_ENV, VOLUME_METRICS_MIDDLEWARE


def samples(collector: VolumeCollector) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(collector)
    return {
        name: value for name, _ in GAUGES if (value := registry.get_sample_value(name)) is not None
    }


def test_the_gauges_are_the_filesystem_s_statvfs(tmp_path: Path) -> None:
    got = samples(VolumeCollector(str(tmp_path)))
    st = os.statvfs(tmp_path)
    assert got["encoderpool_ec_volume_size_bytes"] == st.f_blocks * st.f_frsize
    assert got["encoderpool_ec_volume_files"] == st.f_files
    assert (
        0 <= got["encoderpool_ec_volume_available_bytes"] <= got["encoderpool_ec_volume_size_bytes"]
    )
    assert 0 <= got["encoderpool_ec_volume_files_available"] <= st.f_files


def test_a_volume_that_cannot_be_read_exports_nothing_and_the_scrape_still_works(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    collector = VolumeCollector(str(tmp_path / "gone"))
    registry = CollectorRegistry()
    registry.register(collector)
    with caplog.at_level(logging.WARNING):
        text = generate_latest(registry).decode()
    assert "encoderpool_ec_volume" not in text
    assert "unreadable" in caplog.text
    assert "gone" in caplog.text


def test_the_middleware_passes_requests_on_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(volume_metrics, "_registered", {})
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)
        await send({"type": "http.response.start", "status": 204, "headers": []})

    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "path": "/v1/chat/completions", "headers": []}
    try:
        middleware = VolumeMetrics(app)
        VolumeMetrics(app)  # vLLM may build its app's stack more than once: one collector
        asyncio.run(middleware(scope, receive, send))
        assert seen == [scope]
        assert sent[0]["status"] == 204
        assert (
            REGISTRY.get_sample_value("encoderpool_ec_volume_files") == os.statvfs(tmp_path).f_files
        )
        assert list(volume_metrics._registered) == [str(tmp_path)]
    finally:
        for collector in volume_metrics._registered.values():
            REGISTRY.unregister(collector)


def test_without_the_cache_directory_it_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"{CACHE_DIR_ENV} is empty"):
        VolumeMetrics(lambda *a: None)


def test_vllm_can_import_what_the_operator_names() -> None:
    module, _, name = VOLUME_METRICS_MIDDLEWARE.rpartition(".")
    assert getattr(importlib.import_module(module), name) is VolumeMetrics
