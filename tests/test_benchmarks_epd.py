"""The serving benchmark's request streams, statistics and plot, without engines.

The timings themselves live in benchmarks/epd_serving.py runs (docs/benchmarks-epd.md);
here: the streams every arm gets are what the docs say, and the figures are computed
from the right requests.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.epd_serving import (
    Record,
    Req,
    Sizes,
    Summary,
    Workload,
    build_arms,
    capacity_bound,
    consumer_policy_flags,
    describe_placement,
    pair_ratios,
    parse_args,
    place,
    plot,
    ratios,
    request_body,
    result_line,
    run_workload,
    sse_events,
    summarize,
    tokens_in_chunk,
    workload_summary,
    workloads,
    zipf_ranks,
)
from benchmarks.stats import percentile
from encoderpool_router.config import parse_settings
from tests.router.fixtures import FakeBackend, fakes, router_at, run


def test_workloads_are_deterministic_and_disjoint() -> None:
    first, second = workloads(Sizes()), workloads(Sizes())
    assert first == second
    by_name = {w.name: w for w in first}
    assert list(by_name) == ["unique", "zipf", "multi4", "mixed"]
    images = {n: {i for r in w.requests for i in r.images} for n, w in by_name.items()}
    names = list(images)
    for a in names:  # no workload finds another's images cached
        for b in names[names.index(a) + 1 :]:
            assert not images[a] & images[b], (a, b)


def test_each_workload_has_its_shape() -> None:
    s = Sizes()
    w = {x.name: x for x in workloads(s)}
    unique = [r.images for r in w["unique"].requests]
    assert len(unique) == s.unique
    assert len(set(unique)) == s.unique
    assert all(len(i) == 1 for i in unique)
    zipf = Counter(r.images for r in w["zipf"].requests)
    assert len(w["zipf"].requests) == s.zipf
    assert len(zipf) <= s.zipf_images
    assert zipf.most_common(1)[0][1] >= 3  # repeats across clients...
    assert len({r.text for r in w["zipf"].requests}) == s.zipf  # ...each asking its own question
    multi = w["multi4"].requests
    assert {len(r.images) for r in multi} == {4}
    assert len({i for r in multi for i in r.images}) == 4 * s.multi4
    mixed = w["mixed"]
    decode = [r for r in mixed.requests if r.role == "decode"]
    heavy = [r for r in mixed.requests if r.role == "heavy"]
    assert len(decode) == s.mixed_streams == mixed.concurrency
    assert mixed.loop_until_timed_done
    assert all(not r.images and r.at_s is None for r in decode)
    assert all(len(r.images) == s.mixed_heavy_images for r in heavy)
    arrivals = [r.at_s or 0.0 for r in heavy]
    assert arrivals == sorted(arrivals)
    assert all(a > 0 for a in arrivals)


def test_zipf_favours_low_ranks_and_scaling_keeps_shape() -> None:
    ranks = Counter(zipf_ranks(5000, 8, 1.1, seed=1))
    assert ranks[0] > ranks[1] > ranks[4] > ranks[7] > 0
    big = Sizes().scaled(2.0)
    assert big.unique == 2 * Sizes().unique
    assert big.max_tokens == Sizes().max_tokens


def test_request_body_streams_exact_lengths() -> None:
    body = request_body(Req((1, 2), "Describe.", 16), 448)
    assert body["stream"] is True
    assert body["ignore_eos"] is True
    assert body["max_tokens"] == 16
    assert body["stream_options"] == {"include_usage": True}
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
    # same index, same bytes: every arm gets the identical stream
    assert request_body(Req((1, 2), "Describe.", 16), 448) == body
    assert request_body(Req((), "Text only.", 8), 448)["messages"][0]["content"] == [
        {"type": "text", "text": "Text only."}
    ]


def test_sse_parsing_counts_tokens() -> None:
    lines = [
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n',
        b"\n",
        b'data: {"choices":[{"delta":{"content":"a"},"token_ids":[5]}]}\n',
        b'data: {"choices":[{"delta":{"content":"bc"},"token_ids":[6,7]}]}\n',
        b'data: {"choices":[{"delta":{"content":"d"}}]}\n',
        b'data: {"choices":[],"usage":{"completion_tokens":4}}\n',
        b"data: [DONE]\n",
    ]
    events = list(sse_events(lines))
    assert events[-1] is None
    assert [tokens_in_chunk(e) for e in events if e is not None] == [0, 1, 2, 1, 0]
    with pytest.raises(ValueError, match="not an object"):
        list(sse_events([b"data: [1, 2]"]))


def test_records_and_summaries() -> None:
    r = Record("main", start=0.0, token_times=[0.5, 0.6, 0.7, 0.9], end=1.0)
    assert r.ttft == 0.5
    assert r.tpot == pytest.approx(0.4 / 3)
    assert r.itls == pytest.approx([0.1, 0.1, 0.2])
    assert Record("main", 0.0, [0.2], 0.3).tpot is None
    recs = [Record("main", float(i), [i + 0.1 * (i + 1), i + 0.5], i + 0.6) for i in range(10)]
    s = summarize(recs, "main", "main")
    assert s.n == 10
    assert s.ttft_p50 == pytest.approx(0.5)
    assert s.ttft_p99 == pytest.approx(1.0)
    assert s.rps == pytest.approx(10 / 9.6)
    mixed = [
        Record("decode", 0.0, [0.1, 0.2, 0.9], 1.0),
        Record("heavy", 0.2, [0.7, 0.8], 0.8),
    ]
    m = workload_summary("mixed", mixed)
    assert m.ttft_p50 == pytest.approx(0.5)  # the heavy request's
    assert m.tpot_p50 == pytest.approx(0.4)
    assert m.itl_p99 == pytest.approx(0.7)
    assert percentile([], 50) != percentile([], 50)  # NaN, not an exception


def _summary(ttft: float, tpot: float, rps: float) -> Summary:
    return Summary(
        n=1, ttft_p50=ttft, ttft_p99=ttft, tpot_p50=tpot, tpot_p99=tpot, itl_p99=tpot, rps=rps
    )


def test_ratios_use_the_best_monolithic_layout_per_figure(tmp_path: Path) -> None:
    per = {
        "pool-sharedVolume": _summary(0.1, 0.02, 3.0),
        "mono-2x1": _summary(0.4, 0.05, 2.0),
        "mono-1x2": _summary(0.2, 0.04, 1.0),
    }
    results = {wl: per for wl in ("unique", "zipf", "multi4", "mixed")}
    r = ratios(results, "pool-sharedVolume", ["mono-2x1", "mono-1x2"])
    assert r["zipf"]["ttft_p50"] == pytest.approx(0.5)  # vs mono-1x2's 0.2
    assert r["mixed"]["tpot_p99"] == pytest.approx(0.5)  # vs 0.04
    assert r["multi4"]["rps"] == pytest.approx(1.5)  # vs mono-2x1's 2.0
    assert result_line(r) == "RESULT ttft_p50_ratio=0.50 tpot_p99_ratio=0.50 throughput_ratio=1.50"
    png = tmp_path / "p.png"
    plot(png, {"pool-sharedVolume": r, "pool-rdma": r}, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_placement_splits_devices_and_names_bad_flags() -> None:
    p = place(["0", "1"], 1, [2, 1])
    assert p.producer == ("0",)
    assert p.consumer == ("1",)
    assert p.mono == {2: (("0",), ("1",)), 1: (("0", "1"),)}
    one_gpu = place(["0"], 1, [1])
    assert one_gpu.producer == one_gpu.consumer == ("0",)
    with pytest.raises(ValueError, match="--producer-devices 2"):
        place(["0", "1"], 2, [1])
    with pytest.raises(ValueError, match="--mono-replicas 3"):
        place(["0", "1"], 1, [3])


def test_flags(capsys: pytest.CaptureFixture[str]) -> None:
    a = parse_args(["--device", "cuda", "--devices", "0,1,2,3", "--mono-replicas", "4,2"])
    assert a.mono_replicas == [4, 2]
    assert a.transports == ["sharedVolume", "rdma"]
    with pytest.raises(SystemExit):
        parse_args(["--transports", "carrier-pigeon"])
    assert "unknown ['carrier-pigeon']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--transports", "rdma"])  # headline sharedVolume not measured
    assert json.dumps(vars(parse_args(["--transports", "rdma", "--headline", "rdma"])), default=str)


def test_monolithic_replicas_get_media_affinity_unless_told_otherwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    a = parse_args([])
    assert (a.consumer_policy, a.consumer_load_bound) == ("media-affinity", 0)
    flags = consumer_policy_flags(2, a.consumer_policy, a.consumer_load_bound, a.concurrency)
    # 4 clients over 2 replicas: a hot image fills its replica to 2, then the other
    assert flags == ["--consumer-policy", "media-affinity", "--consumer-load-bound", "2"]
    assert consumer_policy_flags(3, "media-affinity", 0, 4)[-1] == "2"  # ceil(4 / 3)
    assert consumer_policy_flags(2, "media-affinity", 8, 4)[-1] == "8"
    assert consumer_policy_flags(2, "least-busy", 0, 4) == ["--consumer-policy", "least-busy"]
    assert consumer_policy_flags(1, "media-affinity", 0, 4) == []  # one consumer: no choice
    s = parse_settings(["--consumers", "http://127.0.0.1:1,http://127.0.0.1:2", *flags])
    assert (s.consumer_policy, s.consumer_load_bound) == ("media-affinity", 2)
    with pytest.raises(SystemExit):
        parse_args(["--consumer-policy", "random"])
    with pytest.raises(SystemExit):
        parse_args(["--consumer-load-bound", "-1"])
    assert "--consumer-load-bound -1" in capsys.readouterr().err


def test_client_streams_through_the_router_to_fake_backends() -> None:
    """The benchmark's client end to end (closed loop, timed arrivals, SSE timing) without engines.

    The fake consumer streams 4 one-token chunks, so every request asks for 4 tokens.
    """
    wl = Workload(
        "mixed",
        (
            Req((), "stream", 4, "decode"),
            Req((1, 2), "heavy", 4, "heavy", at_s=0.05),
            Req((3,), "heavy", 4, "heavy", at_s=0.1),
        ),
        concurrency=1,
        loop_until_timed_done=True,
    )
    producer, consumer = FakeBackend("producer-0"), FakeBackend("consumer-0")

    async def scenario() -> list[Record]:
        async with (
            fakes(producer, consumer) as (purl, curl),
            router_at([purl], [curl]) as (_, url),
        ):
            return await run_workload(url, wl, 56)

    records = run(scenario())
    roles = Counter(r.role for r in records)
    assert roles["heavy"] == 2
    assert roles["decode"] >= 1  # the stream went round until both heavy requests were done
    assert all(len(r.token_times) == 4 and r.start <= r.ttft + r.start <= r.end for r in records)
    assert len([s for s in producer.seen if s.body]) == 3  # one producer request per image
    summary = workload_summary("mixed", records)
    assert summary.ttft_p50 > 0
    assert summary.n == len(records)


def test_capacity_bound_is_the_encoder_core_against_all_cores() -> None:
    calib = {
        "mono_ttft_fresh_image_ms": 200.0,
        "mono_ttft_cached_image_ms": 20.0,
        "mono_decode_step_ms": 10.0,
    }
    b = capacity_bound(calib, images=4, max_tokens=11, producer=1, consumer=1)
    assert b["encode_s"] == pytest.approx(0.72)
    assert b["rest_s"] == pytest.approx(0.12)
    assert b["pool_rps"] == pytest.approx(1 / 0.72)  # the producer's core is the bottleneck
    assert b["mono_rps"] == pytest.approx(2 / 0.84)
    assert b["ratio"] == pytest.approx(0.84 / 1.44)
    # a split matching E:D lets the pool reach parity, never more
    assert capacity_bound(calib, 4, 11, producer=6, consumer=1)["ratio"] == pytest.approx(1.0)


def test_encoder_heavy_variant_keeps_the_width_and_takes_448px(tmp_path: Path) -> None:
    """The benchmark's model: a bigger vision tower, the same LM and encoder output width."""
    from e2e.tiny_model import ENCODER_HEAVY, HIDDEN, TINY, build

    out = build(tmp_path / "heavy", ENCODER_HEAVY)
    config = json.loads((out / "config.json").read_text())
    vision = config["vision_config"]
    assert vision["hidden_size"] == config["text_config"]["hidden_size"] == HIDDEN
    assert vision["depth"] > TINY.vision_depth
    assert vision["embed_dim"] > TINY.vision_embed_dim
    assert vision["embed_dim"] // vision["num_heads"] == 64
    processor = json.loads((out / "processor_config.json").read_text())
    assert processor["image_processor"]["size"]["longest_edge"] >= 448 * 448


def test_placement_lines_name_each_arms_cores_and_consumer_policy(tmp_path: Path) -> None:
    args = parse_args(["--encoder-width", "64"])
    arms = build_arms(args, tmp_path / "model", tmp_path)
    lines = {line.split(":")[0].strip(): line for line in describe_placement(arms)}
    assert lines["pool-sharedVolume"].endswith("router and client unpinned")  # one consumer
    assert lines["mono-2x1"].endswith(
        "router --consumer-policy media-affinity --consumer-load-bound 2"
    )
    (mono,) = [a for a in arms if a.name == "mono-2x1"]
    assert mono.router_args[-len(mono.policy) :] == mono.policy


def test_dispatch_arms_are_the_same_pool_with_a_store_of_their_own(tmp_path: Path) -> None:
    only_pools = ["--transports", "sharedVolume", "--mono-replicas", ""]
    args = parse_args(["--encoder-width", "64", *only_pools, "--dispatch", "always,when-faster"])
    arms = {a.name: a for a in build_arms(args, tmp_path / "model", tmp_path)}
    assert list(arms) == ["pool-sharedVolume", "pool-sharedVolume-whenFaster"]
    always, faster = arms["pool-sharedVolume"], arms["pool-sharedVolume-whenFaster"]
    assert "--dispatch" not in always.router_args
    assert faster.router_args[-2:] == ["--dispatch", "when-faster"]
    assert (always.dispatch, faster.dispatch) == ("always", "when-faster")
    assert faster.encode_s == 0.0  # timed on its producer before its router starts
    # the same cores, each its own servers and store (no arm finds another's entries)
    stores = set()
    for arm in (always, faster):
        assert [s.cpus for s in arm.servers.values()] == ["0", "1"]
        config = json.loads(flag_after(arm.servers["producer"].extra, "--ec-transfer-config"))
        stores.add(config["ec_connector_extra_config"]["shared_volume"]["root"])
    assert stores == {
        str(tmp_path / "ec" / "pool-sharedVolume"),
        str(tmp_path / "ec" / "pool-sharedVolume-whenFaster"),
    }
    line = describe_placement([faster])[0]
    assert line.endswith("router --dispatch when-faster")
    given = parse_args(["--dispatch", "always,when-faster", "--encode-seconds", "0.2"])
    assert given.encode_seconds == 0.2


@pytest.mark.parametrize("bad", ["when-faster", "always,sometimes", "always,always"])
def test_dispatch_flag_errors(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--dispatch", bad])
    assert "--dispatch" in capsys.readouterr().err


def test_when_faster_is_compared_with_always_of_the_same_transport() -> None:
    def s(ttft: float, rps: float) -> Summary:
        return Summary(4, ttft, ttft * 2, 0.01, 0.02, 0.03, rps)

    results = {
        wl: {"pool-sharedVolume": s(0.4, 2.0), "pool-sharedVolume-whenFaster": s(0.2, 3.0)}
        for wl in ("unique", "zipf", "multi4", "mixed")
    }
    r = pair_ratios(results, "pool-sharedVolume-whenFaster", "pool-sharedVolume")
    assert r["zipf"]["ttft_p50"] == pytest.approx(0.5)
    assert r["multi4"]["rps"] == pytest.approx(1.5)
    assert r["mixed"]["tpot_p99"] == pytest.approx(1.0)
    assert result_line(r, "DISPATCH_SHAREDVOLUME") == (
        "DISPATCH_SHAREDVOLUME ttft_p50_ratio=0.50 tpot_p99_ratio=1.00 throughput_ratio=1.50"
    )


def flag_after(args: object, name: str) -> str:
    values = list(args)  # type: ignore[call-overload]
    return str(values[values.index(name) + 1])
