"""The router benchmarks' own logic (the load runs themselves are benchmarks, not tests)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.router_load import PATHS, Conn, Req, rotation, run_phase
from e2e.vllm_server import REPO, base_env


def test_the_floor_benchmark_times_each_pass_and_sums_them() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.router_floor", "--mb", "1", "--reps", "3"],
        env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    passes = [float(m) for m in re.findall(r"^  .+? +(\d+\.\d+) ms$", res.stdout, re.M)]
    assert len(passes) == 5, res.stdout
    assert min(passes) >= 0
    (floor,) = re.findall(r"^RESULT floor_ms=(\d+\.\d+)$", res.stdout, re.M)
    assert float(floor) > 0
    assert abs(float(floor) - sum(passes)) < 0.01


def test_the_load_rotation_keeps_a_router_beside_its_baseline_twin() -> None:
    for rnd in range(4):  # without twins: the plain rotation
        k = rnd % len(PATHS)
        assert rotation(PATHS, rnd) == [*PATHS[k:], *PATHS[:k]]
    paths = ("direct", "reuse", "every-item", "reuse@base", "every-item@base")
    assert rotation(paths, 0) == ["direct", "reuse", "reuse@base", "every-item", "every-item@base"]
    assert rotation(paths, 1) == ["reuse@base", "reuse", "every-item@base", "every-item", "direct"]
    assert rotation(paths, 2) == ["every-item", "every-item@base", "direct", "reuse", "reuse@base"]


def test_a_load_phase_opens_again_connections_the_server_closed_while_idle() -> None:
    """A router may close kept-alive connections idle past its head timeout (the other
    paths' phases run meanwhile): the next phase opens them again before timing."""
    opened = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal opened
        opened += 1
        with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError):
            while True:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.2)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        writer.close()  # idle 0.2 s: closed, as the router does past --head-timeout-s

    async def scenario() -> list[int]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conns = [Conn(port) for _ in range(3)]
        answers = []
        for _ in range(2):
            phase = await run_phase(conns, [Req(b"{}", 0.0, 0)], 2)
            answers.append(phase.answers)
            await asyncio.sleep(0.5)
        for c in conns:
            c.close()
        server.close()
        return answers

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == [6, 6]
    assert opened == 6


def test_the_load_benchmark_runs_a_baseline_ref_router_beside_the_current_one() -> None:
    """A smoke run (a few requests per phase) with HEAD as the baseline: both routers in
    both modes, the baseline's RESULT lines and ratios, its extracted tree removed."""
    cpus = sorted(os.sched_getaffinity(0))
    argv = [sys.executable, "-m", "benchmarks.router_load", "--baseline-ref", "HEAD"]
    argv += ["--concurrency", "4", "--requests", "3", "--rounds", "2", "--nice", "0"]
    argv += ["--scenarios", "small,large", "--large-mb", "0.2", "--large-requests", "2"]
    argv += ["--per-token-ms", "0.5", "--per-mb-ms", "10"]
    argv += ["--router-cpus", str(cpus[0]), "--load-cpus", str(cpus[-1])]
    res = subprocess.run(
        argv, env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    for path in ("reuse", "every-item", "reuse@base", "every-item@base"):
        # small: 4 clients x 3 requests x 2 rounds; large: 4 x 2 x 2
        for n in (24, 16):
            assert re.search(rf"^ *{path} excess ms: .*/{n}\)", out, re.M), out
    x = r"-?\d+\.\d\d"
    figures = rf"router_added_ms_p50={x} p99={x} large_p50={x}"
    for label in ("RESULT", "RESULT_EVERY_ITEM"):
        assert re.search(rf"^{label} {figures}$", out, re.M), out
    for label in ("RESULT_BASELINE", "RESULT_BASELINE_EVERY_ITEM"):
        assert re.search(rf"^{label} {figures} ref={head}$", out, re.M), out
    ratios = rf"router_added_ms_p50=({x}|nan) p99=({x}|nan) large_p50=({x}|nan)"
    for label in ("RESULT_RATIO", "RESULT_RATIO_EVERY_ITEM"):
        assert re.search(rf"^{label} {ratios} ref={head}$", out, re.M), out
    assert (
        len(re.findall(rf"^COMPARE (small|large) (reuse|every-item): .+\({head}\)", out, re.M)) == 4
    )
    (tree,) = re.findall(r"^baseline: .+, extracted to (\S+)$", out, re.M)
    assert not Path(tree).exists()
