"""Does autoscaling pay? One traffic step against an autoscaling pool and a fixed one, side by side.

    python -m benchmarks.autoscale [--text-s 180 --image-s 300 --idle-s 180]
        [--plot docs/autoscale.png] [--keep]

On kind with the real KEDA and Prometheus (built from their Go modules, as ``make
test`` runs them) and the operator's chart, two pools of the tiny Qwen2-VL in two
namespaces, started together and sent the same traffic at the same time:

- ``auto``: producers autoscale between 0 and 2 (target one item in flight per pod),
  consumers between 1 and 2 (target 4 requests running or waiting per pod), each with
  a 60 s scale-down window;
- ``fixed``: 2 producers and 2 consumers, the autoscaling arm's maximum, always.

The step, once both pools are ready and the autoscaling one's producers asleep:
``text`` (``--text-clients`` closed-loop clients of text-only requests with 48-token
answers), then ``image`` (``--image-clients`` clients of requests with one new 448-px
image each, the most the tiny model takes, and 4-token answers), then ``idle``.
Requests stream; TTFT is measured here.
Each pool's Deployments are read every second (spec, existing and ready pods), from
which: the time from each phase's start to the first scale-up decision (a higher
``spec.replicas``) and to the new pod Ready, and the replica-seconds of each role
(existing pods, integrated over the step; the routers are the same in both arms and
not counted).

Last line: ``RESULT autoscale_failed=<auto arm's failed requests>
replica_seconds_ratio=<auto/fixed> ttft_p99_ratio=<auto/fixed, image phase>
scale_up_decision_s=<image phase, producers>``. Targets: 0 failed, replica-seconds at
most 0.6 of fixed, TTFT p99 at most 1.5x fixed, decision within 30 s. Results and the
plot (replicas per role over time, both arms) in docs/benchmarks-autoscale.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.stats import percentile
from e2e.cluster.runner import bin_dir
from e2e.kind import monitoring
from e2e.kind.cluster import ROOT, Engine, Images, KindCluster
from e2e.kind.load import Answer, Load, ReplicaSampler, Sample, failures
from e2e.kind.pool import sample_pool, wait_ready
from e2e.processes import exit_on_sigterm
from e2e.tiny_model import ensure_tiny_model
from tests.waiting import wait_until

POOL = "bench"
ARMS = ("auto", "fixed")
PHASES = ("text", "image", "idle")
ROLES = ("producer", "consumer")
MAX_REPLICAS = 2
SCALE_DOWN = {"stabilizationWindowSeconds": 60}
AUTOSCALING = {
    "producer": {
        "minReplicas": 0,
        "maxReplicas": MAX_REPLICAS,
        "target": 1,
        "scaleDown": SCALE_DOWN,
    },
    "consumer": {
        "minReplicas": 1,
        "maxReplicas": MAX_REPLICAS,
        "target": 4,
        "scaleDown": SCALE_DOWN,
    },
}


def namespace(arm: str) -> str:
    return f"bench-{arm}"


def deployment(role: str) -> str:
    return f"{POOL}-{role}"


def for_arm(arm: str, pool: dict[str, Any]) -> dict[str, Any]:
    """The sample pool as the kind tests run it (``sample_pool``), autoscaling or fixed."""
    # Two pools and the platform on one 2-core node: CPU requests small enough that every
    # pod of both arms at their maximum is scheduled (they compete for the cores anyway).
    for role in ROLES:
        pool["spec"][role]["resources"]["requests"] = {"cpu": "20m", "memory": "1Gi"}
    pool["spec"]["router"]["resources"] = {
        "requests": {"cpu": "50m", "memory": "256Mi"},
        "limits": {"cpu": "2", "memory": "2Gi"},
    }
    for role in ROLES:
        if arm == "auto":
            pool["spec"][role]["autoscaling"] = AUTOSCALING[role]
        else:
            pool["spec"][role]["replicas"] = MAX_REPLICAS
    return pool


@dataclass
class Phase:
    name: str
    start: float
    end: float
    answers: dict[str, list[Answer]]  # by arm


def ttfts(answers: Sequence[Answer]) -> list[float]:
    return [a.ttft_s for a in answers if a.ttft_s is not None and a.status == 200]


def first_after(samples: Sequence[Sample], since: float, test: Any) -> float | None:
    """Seconds from ``since`` to the first sample after it that passes ``test``."""
    return next((s.at - since for s in samples if s.at >= since and test(s)), None)


def scale_up(samples: Sequence[Sample], phase: Phase) -> tuple[float | None, float | None]:
    """(decision, ready): seconds from the phase's start to the first higher
    ``spec.replicas``, and to more pods ready, than at its start (None: none in the phase)."""
    before = [s for s in samples if s.at <= phase.start] or samples[:1]
    if not before:
        return None, None
    base = before[-1]
    inside = [s for s in samples if s.at <= phase.end]
    decided = first_after(inside, phase.start, lambda s: (s.replicas or 0) > (base.replicas or 0))
    ready = first_after(inside, phase.start, lambda s: s.ready > base.ready)
    return decided, ready


@contextlib.contextmanager
def forwarded(kind: KindCluster) -> Iterator[dict[str, str]]:
    """Each arm's router on a local port."""
    with contextlib.ExitStack() as stack:
        yield {
            arm: stack.enter_context(kind.port_forward(namespace(arm), f"service/{POOL}", 8000))
            for arm in ARMS
        }


def traffic_step(
    kind: KindCluster, args: argparse.Namespace, samplers: dict[str, ReplicaSampler]
) -> list[Phase]:
    phases: list[Phase] = []
    plan = (("text", args.text_s, args.text_clients), ("image", args.image_s, args.image_clients))
    with forwarded(kind) as urls:
        for name, seconds, clients in plan:
            start = time.monotonic()
            loads = {arm: Load(urls[arm], name, clients).start() for arm in ARMS}
            print(f"# {name}: {clients} clients per arm for {seconds:.0f} s", flush=True)
            time.sleep(seconds)
            answers = {arm: load.stop() for arm, load in loads.items()}
            phases.append(Phase(name, start, time.monotonic(), answers))
            report_replicas(samplers)
    start = time.monotonic()
    print(f"# idle for {args.idle_s:.0f} s", flush=True)
    time.sleep(args.idle_s)
    phases.append(Phase("idle", start, time.monotonic(), {arm: [] for arm in ARMS}))
    report_replicas(samplers)
    return phases


def report_replicas(samplers: dict[str, ReplicaSampler]) -> None:
    parts = []
    for arm, sampler in samplers.items():
        for role in ROLES:
            s = sampler.latest(deployment(role))
            parts.append(f"{arm}-{role}={s.ready if s else '?'}/{s.existing if s else '?'}")
    print(f"#   ready/existing: {' '.join(parts)}", flush=True)


def summarize(phases: list[Phase], samplers: dict[str, ReplicaSampler]) -> dict[str, Any]:
    start, end = phases[0].start, phases[-1].end
    out: dict[str, Any] = {"arms": {}}
    for arm in ARMS:
        sampler = samplers[arm]
        rs = {r: sampler.replica_seconds(deployment(r), start, end) for r in ROLES}
        per_phase: dict[str, dict[str, Any]] = {}
        for p in phases:
            t = ttfts(p.answers[arm])
            per_phase[p.name] = {
                "requests": len(p.answers[arm]),
                "failed": len(failures(p.answers[arm])),
                "ttft_p50_ms": percentile(t, 50) * 1000,
                "ttft_p99_ms": percentile(t, 99) * 1000,
                "replica_s": {
                    r: sampler.replica_seconds(deployment(r), p.start, p.end) for r in ROLES
                },
            }
        text = next(p for p in phases if p.name == "text")
        image = next(p for p in phases if p.name == "image")
        out["arms"][arm] = {
            "replica_s": rs,
            "phases": per_phase,
            "failed": sum(v["failed"] for v in per_phase.values()),
            "producer_up": scale_up(sampler.of(deployment("producer")), image),
            "consumer_up": scale_up(sampler.of(deployment("consumer")), text),
        }
    auto, fixed = out["arms"]["auto"], out["arms"]["fixed"]
    out["replica_seconds_ratio"] = sum(auto["replica_s"].values()) / max(
        1e-9, sum(fixed["replica_s"].values())
    )
    out["ttft_p99_ratio"] = (
        auto["phases"]["image"]["ttft_p99_ms"] / fixed["phases"]["image"]["ttft_p99_ms"]
    )
    return out


def fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None or v != v else f"{v:.0f}{unit}" if v >= 10 else f"{v:.1f}{unit}"


def print_tables(summary: dict[str, Any]) -> None:
    print(
        "| arm | phase | requests | failed | TTFT p50 / p99 ms | producer pod-s | consumer pod-s |"
    )
    print("|---|---|---|---|---|---|---|")
    for arm, a in summary["arms"].items():
        for name, p in a["phases"].items():
            rs = p["replica_s"]
            print(
                f"| {arm} | {name} | {p['requests']} | {p['failed']} | "
                f"{fmt(p['ttft_p50_ms'])} / {fmt(p['ttft_p99_ms'])} | "
                f"{fmt(rs['producer'])} | {fmt(rs['consumer'])} |"
            )
    print()
    print("| arm | producer pod-s | consumer pod-s | producers up (decision / ready s, image) |"
          " consumers up (decision / ready s, text) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for arm, a in summary["arms"].items():
        pd, pr = a["producer_up"]
        cd, cr = a["consumer_up"]
        print(
            f"| {arm} | {fmt(a['replica_s']['producer'])} | {fmt(a['replica_s']['consumer'])} | "
            f"{fmt(pd)} / {fmt(pr)} | {fmt(cd)} / {fmt(cr)} |"
        )


def plot(path: Path, phases: list[Phase], samplers: dict[str, ReplicaSampler], title: str) -> None:
    """Replicas per role over the step, one panel per arm: existing pods (solid) and ready
    pods (thin), the phases shaded (Pillow: no extra packages)."""
    from PIL import Image, ImageDraw

    t0, t1 = phases[0].start, phases[-1].end
    w, panel_h, left, top, gap = 1100, 230, 70, 50, 50
    h = top + len(ARMS) * (panel_h + gap) + 40
    im = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(im)
    d.text((left, 15), title, fill="black")
    colors = {"producer": (31, 119, 180), "consumer": (255, 127, 14)}
    shades = {"text": (240, 240, 250), "image": (250, 240, 235), "idle": (245, 245, 245)}
    plot_w = w - left - 30

    def x(t: float) -> float:
        return left + plot_w * (t - t0) / max(1e-9, t1 - t0)

    for i, arm in enumerate(ARMS):
        y0 = top + i * (panel_h + gap)

        def y(v: float, y0: float = y0) -> float:
            return y0 + panel_h * (1 - v / (MAX_REPLICAS + 0.5))

        for p in phases:
            d.rectangle([x(p.start), y0, x(p.end), y0 + panel_h], fill=shades[p.name])
            d.text((x(p.start) + 4, y0 + 4), p.name, fill="black")
        for v in range(MAX_REPLICAS + 1):
            d.line([(left, y(v)), (w - 30, y(v))], fill=(200, 200, 200))
            d.text((left - 20, y(v) - 6), str(v), fill="black")
        d.text((5, y0 + panel_h / 2), arm, fill="black")
        for k, role in enumerate(ROLES):
            seen = [s for s in samplers[arm].of(deployment(role)) if t0 <= s.at <= t1]
            off = (k - 0.5) * 0.06  # the two roles' lines side by side where they overlap
            for attr, width in (("existing", 3), ("ready", 1)):
                pts: list[tuple[float, float]] = []
                for s in seen:
                    v = getattr(s, attr) + off
                    if pts:
                        pts.append((x(s.at), pts[-1][1]))  # a step, not a slope
                    pts.append((x(s.at), y(v)))
                if len(pts) > 1:
                    d.line(pts, fill=colors[role], width=width)
    ly = h - 30
    for k, role in enumerate(ROLES):
        lx = left + k * 260
        d.rectangle([lx, ly, lx + 12, ly + 12], fill=colors[role])
        d.text((lx + 16, ly), f"{role}s: pods (thick), ready (thin)", fill="black")
    d.text((left + 560, ly), f"x: {t1 - t0:.0f} s of the traffic step", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path, format="PNG")


def commit() -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--text-s", type=float, default=180, help="the text-only phase, seconds")
    ap.add_argument("--image-s", type=float, default=300, help="the image-heavy phase, seconds")
    ap.add_argument("--idle-s", type=float, default=180, help="the idle phase, seconds")
    ap.add_argument("--text-clients", type=int, default=10)
    ap.add_argument("--image-clients", type=int, default=3)
    ap.add_argument("--plot", type=Path, help="draw replicas per role over time to this PNG")
    ap.add_argument("--keep", action="store_true", help="leave the kind cluster running")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    engine = Engine.ensure()
    kind: KindCluster | None = None
    try:
        images = Images.build({**os.environ, "DOCKER_HOST": engine.host})
        kind = KindCluster.up("encoderpool-bench", engine, bin_dir())
        images = kind.push_images(images)
        prom = kind.push(monitoring.build_image({**kind.env, "DOCKER_HOST": engine.host}))
        monitoring.install(kind, prom)
        kind.install_operator(
            images, f"autoscaling.prometheus.address={monitoring.PROMETHEUS_ADDRESS}"
        )
        model = ensure_tiny_model()
        for arm in ARMS:
            kind.apply(for_arm(arm, sample_pool(kind, namespace(arm), POOL, model, images.vllm)))
        for arm in ARMS:
            print(f"# {arm}: ready in {wait_ready(kind, namespace(arm), POOL):.0f} s", flush=True)
        samplers = {arm: ReplicaSampler(kind, namespace(arm)).start() for arm in ARMS}
        try:
            auto = samplers["auto"]

            def asleep() -> bool:
                s = auto.latest(deployment("producer"))
                return s is not None and s.replicas == 0 and s.existing == 0

            wait_until("the autoscaling arm's producers asleep", asleep, timeout=900, interval=2)
            phases = traffic_step(kind, args, samplers)
        finally:
            for s in samplers.values():
                s.stop()
        summary = summarize(phases, samplers)
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(f"# {when}, commit {commit()}, {os.cpu_count()} cores")
        print_tables(summary)
        for p in phases:
            for arm, answers in p.answers.items():
                for a in failures(answers)[:5]:
                    at = a.started - phases[0].start
                    print(f"# failed: {arm} {p.name} at {at:.0f} s: {a.status} {a.error[:200]}")
        if args.plot:
            title = f"replicas per role, auto vs fixed, {when} ({commit()})"
            plot(args.plot, phases, samplers, title)
            print(f"# plot: {args.plot}")
        auto_arm = summary["arms"]["auto"]
        decision = auto_arm["producer_up"][0]
        print(
            f"RESULT autoscale_failed={auto_arm['failed']} "
            f"replica_seconds_ratio={summary['replica_seconds_ratio']:.2f} "
            f"ttft_p99_ratio={summary['ttft_p99_ratio']:.2f} "
            f"scale_up_decision_s={fmt(decision)}"
        )
        return 0
    except Exception:
        if kind is not None:
            print(kind.diagnose([namespace(a) for a in ARMS]), file=sys.stderr)
        raise
    finally:
        if kind is not None and not args.keep:
            kind.down()
        engine.stop()


if __name__ == "__main__":
    sys.exit(main())
