"""Two producers and two consumers on one small shared directory: eviction keeps it under
its capacity for a run of many images while every answer stays equal to a monolithic server's.

224x224 images give 64 tokens x 128 x bf16 = 16 KiB entries; a 1 MiB capacity (the
smallest a pool accepts) holds about 60, so 72 images force evictions while consumers read.
The file sorts before the package's modules that share ``sv_servers``: it runs before
that pool starts, so only its own four servers and the session's monolithic one are up.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from e2e.media import chat_request, encoder_request, image, image_part, token_ids
from e2e.vllm_server import VllmServer
from encoderpool_connector.shared_volume.entry import entry_name
from encoderpool_connector.shared_volume.store import SharedStore
from tests.connector.fixtures import EpFactory, metric, sv_config, tiny_fingerprint

pytestmark = pytest.mark.vllm


CAPACITY = 1 << 20
N_IMAGES = 72


def test_two_producers_two_consumers_under_capacity(
    ep_servers: EpFactory, monolithic: VllmServer, tiny_model: Path, tmp_path: Path
) -> None:
    images = [image(1000 + i, size=(224, 224)) for i in range(N_IMAGES)]
    expected = [token_ids(monolithic.chat(chat_request(png))) for png in images]

    root = tmp_path / "ec"
    fp = tiny_fingerprint(tiny_model)
    extra = sv_config(root, fp, capacity_bytes=CAPACITY)
    servers = [
        ep_servers(f"{role}-{i}", role=f"ec_{role}", extra=extra)
        for role in ("producer", "consumer")
        for i in (0, 1)
    ]
    for s in servers:
        s.wait_ready(300)
    producers, consumers = servers[:2], servers[2:]
    store = SharedStore(str(root), CAPACITY, "lru")
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if (root / "entries").is_dir():
                peak[0] = max(peak[0], store.total_bytes())
            stop.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    mismatches: list[int] = []
    errors: list[BaseException] = []

    def lane(k: int) -> None:
        """One client: both producers encode each of its items (same key, racing publishes)."""
        try:
            for i in range(k, N_IMAGES, 2):
                part = image_part(images[i])
                params = {}
                for p in producers:
                    params.update(p.chat(encoder_request(part))["ec_transfer_params"])
                body = chat_request(images[i])
                body["ec_transfer_params"] = params
                if token_ids(consumers[(i // 2) % 2].chat(body)) != expected[i]:
                    mismatches.append(i)
        except BaseException as e:  # surfaced below
            errors.append(e)

    lanes = [threading.Thread(target=lane, args=(k,)) for k in (0, 1)]
    for t in lanes:
        t.start()
    for t in lanes:
        t.join(400)
    stop.set()
    watcher.join()
    assert not errors, errors
    assert mismatches == []
    assert 0 < peak[0] <= CAPACITY
    assert store.total_bytes() <= CAPACITY
    names = {p.name for p in (root / "entries").iterdir()}
    assert len(names) < N_IMAGES  # some were evicted
    assert entry_name(fp, "never-published") not in names
    assert list((root / "tmp").iterdir()) == []  # no partial files left behind
    # Consumers really loaded (rather than silently encoding everything themselves).
    hits = sum(metric(c, "encoderpool_ec_hits_total") for c in consumers)
    assert hits >= 0.9 * N_IMAGES
