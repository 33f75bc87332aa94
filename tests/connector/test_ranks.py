"""Tensor-parallel rank logic of both transports without an engine: two worker ranks in
threads, a stand-in for the TP group's all-reduce, and the scheduler side as vLLM drives it.

Each rank gets its own unpickled copy of the step's scheduler output, as the
multiprocess executor sends it, so a rank's additions to the encoder inputs
land where that rank's model runner reads them. The real engine at TP=2 is
tests/connector/tp2/test_tp2_*.py.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from encoderpool_connector.core.metadata import WorkerReport
from encoderpool_connector.core.ranks import FAULT_ENV, Rank, recompute
from encoderpool_connector.rdma.buffer import SharedRegion
from encoderpool_connector.rdma.metadata import LoadPlan, RdmaMetadata, RdmaWorkerMetadata
from encoderpool_connector.rdma.worker import RdmaWorker
from encoderpool_connector.shared_volume.entry import Header, entry_name
from encoderpool_connector.shared_volume.metadata import SharedVolumeWorkerMetadata
from encoderpool_connector.shared_volume.scheduler import SharedVolumeScheduler
from encoderpool_connector.shared_volume.store import SharedStore
from encoderpool_connector.shared_volume.worker import SharedVolumeWorker
from encoderpool_contracts import ConnectorConfig
from encoderpool_contracts.integrity import checksum

FP = "0123456789abcdef"
TOKENS, WIDTH = 4, 8


class Group:
    """Two ranks' all-reduce (MAX), as threads: each waits for the other's flags."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.flags: list[list[bool]] = [[], []]
        self.calls = 0


class FakeRank(Rank):
    def __init__(self, group: Group, rank: int, fail: bool = False) -> None:
        super().__init__(rank, 2)
        self.group = group
        self.fail = fail

    def injected_fault(self) -> bool:
        return self.fail

    def agree(self, failed: Sequence[bool]) -> list[bool]:
        self.group.flags[self.rank] = list(failed)
        self.group.barrier.wait()
        out = [a or b for a, b in zip(*self.group.flags, strict=True)]
        self.group.barrier.wait()
        if self.rank == 0:
            self.group.calls += 1
        return out


def on_both(step: Callable[[int], Any]) -> list[Any]:
    """Run ``step(rank)`` for ranks 0 and 1 at once (the collective needs both)."""
    out: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = step(r)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    return out


def unpickled(wire: bytes) -> Any:
    """One rank's copy of the step's scheduler output (bytes this test pickled itself)."""
    return pickle.loads(wire)  # noqa: S301


def merged(reports: list[WorkerReport | None]) -> Any:
    """What vLLM's ECOutputAggregator hands the scheduler: the ranks' reports aggregated."""
    out: WorkerReport | None = None
    for r in reports:
        if r is not None:
            out = r if out is None else out.aggregate(r)
    return out


# ---- shared volume ----


def sv_config(root: Path) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config(
        {
            "transport": "sharedVolume",
            "model_fingerprint": FP,
            "encoder_output_widths": {"image": WIDTH},
            "shared_volume": {"root": str(root), "capacity_bytes": 1 << 20},
        }
    )


def request(rid: str, hashes: list[str]) -> SimpleNamespace:
    features = [
        SimpleNamespace(
            identifier=h,
            modality="image",
            mm_position=SimpleNamespace(offset=10 + 100 * i, length=TOKENS),
        )
        for i, h in enumerate(hashes)
    ]
    return SimpleNamespace(
        request_id=rid,
        mm_features=features,
        ec_transfer_params=None,
        get_num_encoder_embeds=lambda i: TOKENS,
    )


def publish(store: SharedStore, mm_hash: str) -> torch.Tensor:
    t = torch.randn(TOKENS, WIDTH).to(torch.bfloat16)
    payload = memoryview(t.view(torch.uint8).numpy()).cast("B")
    header = Header(mm_hash, FP, "bfloat16", (TOKENS, WIDTH), checksum(payload))
    assert store.publish(entry_name(FP, mm_hash), header, payload).published
    return t


class SvConsumer:
    """A TP=2 shared-volume consumer: one scheduler side, two worker ranks."""

    def __init__(self, root: Path, fail_on: int | None = None) -> None:
        config = sv_config(root)
        self.sched = SharedVolumeScheduler(
            config,
            SharedStore(str(root), 1 << 20, "lru"),
            is_producer=False,
            is_consumer=True,
            model_dtype="bfloat16",
            widths=dict(config.encoder_output_widths),
            metadata_resolver=None,
        )
        group = Group()
        self.workers = [
            SharedVolumeWorker(
                config,
                SharedStore(str(root), 1 << 20, "lru"),
                is_producer=False,
                is_consumer=True,
                rank=FakeRank(group, r, fail=r == fail_on),
            )
            for r in (0, 1)
        ]
        for w in self.workers:
            w._device = torch.device("cpu")
        self.caches: list[dict[str, torch.Tensor]] = [{}, {}]
        self.inputs: list[dict[str, list[int]]] = [{}, {}]

    def step(self, req: SimpleNamespace) -> Any:
        """Decide, allocate, one step on both ranks; returns the merged worker report."""
        deadline = time.monotonic() + 10
        while not self.sched.ensure_cache_available(req, 0):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for i, f in enumerate(req.mm_features):
            assert self.sched.has_cache_item(f.identifier)
            self.sched.update_state_after_alloc(req, i)
        output = SimpleNamespace(scheduled_encoder_inputs={"other": [0]})
        output.ec_connector_metadata = self.sched.build_connector_meta(output)
        wire = pickle.dumps(output)  # what the executor sends every rank

        def run(r: int) -> WorkerReport | None:
            mine = unpickled(wire)
            self.workers[r].start_load_caches(self.caches[r], mine.ec_connector_metadata)
            self.inputs[r] = mine.scheduled_encoder_inputs
            return self.workers[r].build_connector_worker_meta()

        report = merged(on_both(run))
        self.sched.update_connector_output(report)
        return report

    def pins(self) -> list[str]:
        return os.listdir(self.sched.pins.dir)

    def close(self) -> None:
        self.sched.shutdown()


def test_sv_every_rank_loads_and_pins_go_only_after_the_merged_report(tmp_path: Path) -> None:
    producer = SharedStore(str(tmp_path), 1 << 20, "lru")
    producer.prepare_producer()
    want = {h: publish(producer, h) for h in ("a", "b")}
    c = SvConsumer(tmp_path)
    try:
        req = request("r1", ["a", "b"])
        deadline = time.monotonic() + 10
        while not c.sched.ensure_cache_available(req, 0):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for i in range(2):
            c.sched.update_state_after_alloc(req, i)
        output = SimpleNamespace(scheduled_encoder_inputs={})
        output.ec_connector_metadata = c.sched.build_connector_meta(output)
        wire = pickle.dumps(output)

        def run(r: int) -> WorkerReport | None:
            c.workers[r].start_load_caches(c.caches[r], unpickled(wire).ec_connector_metadata)
            return c.workers[r].build_connector_worker_meta()

        reports = on_both(run)
        # Both ranks loaded from the same two pins; neither dropped them (the other
        # rank might not have read yet): that is the scheduler's job, after the merge.
        assert len(c.pins()) == 2
        for r in (0, 1):
            for h, t in want.items():
                assert torch.equal(c.caches[r][h], t)
        report = merged(reports)
        assert isinstance(report, SharedVolumeWorkerMetadata)
        assert len(report.released) == 2
        assert report.stats["loads"] == 2  # rank 0's count only: items, not items x ranks
        c.sched.update_connector_output(report)
        assert c.pins() == []
        stats = c.sched.stats.take()
        assert stats is not None
        assert stats.data["hits"] == 2
        assert stats.data["loads"] == 2
        assert "load_failures" not in stats.data
    finally:
        c.close()


def test_sv_a_load_failing_on_one_rank_is_encoded_by_all_never_zeros(tmp_path: Path) -> None:
    producer = SharedStore(str(tmp_path), 1 << 20, "lru")
    producer.prepare_producer()
    publish(producer, "a")
    c = SvConsumer(tmp_path, fail_on=1)
    try:
        report = c.step(request("r1", ["a"]))
        for r in (0, 1):
            assert "a" not in c.caches[r], f"rank {r} kept an embedding the other lacks"
            # Each rank's model runner encodes the item in this very step.
            assert c.inputs[r] == {"other": [0], "r1": [0]}
        assert report.failed == {"a"}
        assert c.pins() == []  # released all the same
        assert c.sched.take_unavailable_requests() == set()  # the request goes on
        stats = c.sched.stats.take()
        assert stats is not None
        assert stats.data["load_failures"] == 1  # one item, though ranks both dropped it
        assert stats.data["loads"] == 1  # rank 0 did load it before the ranks agreed
    finally:
        c.close()


def test_sv_only_the_lead_rank_writes(tmp_path: Path) -> None:
    config = sv_config(tmp_path)
    group = Group()
    workers = [
        SharedVolumeWorker(
            config,
            SharedStore(str(tmp_path), 1 << 20, "lru"),
            is_producer=True,
            is_consumer=False,
            rank=FakeRank(group, r),
        )
        for r in (0, 1)
    ]
    out = torch.randn(TOKENS, WIDTH).to(torch.bfloat16)
    for w in workers:
        w.save_caches({"p": out}, "p")
    assert workers[0].writer is not None
    assert workers[1].writer is None
    workers[0].writer.flush()
    assert (tmp_path / "entries" / entry_name(FP, "p")).is_file()
    reports = [w.build_connector_worker_meta() for w in workers]
    assert reports[1] is None
    assert merged(reports).stats["published"] == 1
    for w in workers:
        w.shutdown()


# ---- rdma ----


def rdma_config(shm_dir: str) -> ConnectorConfig:
    return ConnectorConfig(
        transport="rdma",
        model_fingerprint=FP,
        encoder_output_widths={"image": WIDTH},
        rdma={"side_channel_port": 40000, "buffer_bytes": 1 << 20, "shm_dir": shm_dir},
    )


@pytest.mark.parametrize("fail_on", [None, 0, 1])
def test_rdma_ranks_copy_out_fail_together_and_count_once(fail_on: int | None) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ep-ranks-") as shm:
        region = SharedRegion.create(shm, 1 << 20)
        try:
            t = torch.randn(TOKENS, WIDTH).to(torch.bfloat16)
            raw = t.view(torch.uint8).numpy().tobytes()
            region.view[4096 : 4096 + len(raw)] = raw
            group = Group()
            config = rdma_config(shm)
            workers = [
                RdmaWorker(
                    config,
                    is_producer=True,
                    is_consumer=True,
                    rank=FakeRank(group, r, fail=r == fail_on),
                )
                for r in (0, 1)
            ]
            assert [w.is_producer for w in workers] == [True, False]  # rank 0 copies in
            plan = LoadPlan("h", 4096, "bfloat16", (TOKENS, WIDTH), "r1", 2)
            output = SimpleNamespace(scheduled_encoder_inputs={})
            output.ec_connector_metadata = RdmaMetadata(
                region=region.path,
                region_bytes=region.size,
                loads=[plan],
                encoder_inputs=output.scheduled_encoder_inputs,
            )
            wire = pickle.dumps(output)
            caches: list[dict[str, torch.Tensor]] = [{}, {}]

            def run(r: int) -> tuple[dict[str, list[int]], WorkerReport | None]:
                mine = unpickled(wire)
                workers[r].start_load_caches(caches[r], mine.ec_connector_metadata)
                return mine.scheduled_encoder_inputs, workers[r].build_connector_worker_meta()

            results = on_both(run)
            report = merged([rep for _, rep in results])
            assert isinstance(report, RdmaWorkerMetadata)
            if fail_on is None:
                for r in (0, 1):
                    assert torch.equal(caches[r]["h"], t)
                    assert results[r][0] == {}
                assert report.loaded == {"h"}
                assert report.failed == set()
                assert report.stats["loads"] == 1
            else:
                for r in (0, 1):
                    assert "h" not in caches[r]
                    assert results[r][0] == {"r1": [2]}
                assert report.failed == {"h"}
                assert "load_failures" not in report.stats  # the scheduler counts per item
            for w in workers:
                w.shutdown()
        finally:
            region.close()


# ---- pieces ----


def test_recompute_adds_each_item_once_and_replaces_lists() -> None:
    from encoderpool_connector.core.ranks import Failing

    held = [1]
    inputs = {"r1": held}
    cache: dict[str, Any] = {"a": "stale"}
    recompute(cache, inputs, [Failing("a", "r1", 0), Failing("b", "r2", 3)])
    recompute(cache, inputs, [Failing("a", "r1", 0)])
    assert inputs == {"r1": [1, 0], "r2": [3]}
    assert held == [1]  # the scheduler's own list is left alone
    assert cache == {}


def test_the_fault_hook_names_a_rank_and_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = tmp_path / "fail"
    monkeypatch.setenv(FAULT_ENV, f"1:{flag}")
    assert not Rank(0, 2).injected_fault()
    one = Rank(1, 2)
    assert not one.injected_fault()  # no file yet
    flag.touch()
    assert one.injected_fault()
    assert not Rank(0, 2).injected_fault()
    for bad in ("x:/y", "1:", "/only/a/path"):
        monkeypatch.setenv(FAULT_ENV, bad)
        assert not Rank(1, 2).injected_fault()
    monkeypatch.delenv(FAULT_ENV)
    assert not Rank(1, 2).injected_fault()


def test_a_single_rank_agrees_with_itself_without_a_group() -> None:
    rank = Rank(0, 1)
    assert rank.lead
    assert rank.agree([False, True]) == [False, True]
