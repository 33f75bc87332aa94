"""The front door holds, on the router process as the operator renders it: one hostile
client mounts each attack (``e2e.front_door``) while another client and the kubelet's
probes need the router, under the container's memory limit (a cgroup).

Asserted per phase: the router never dies (so it never restarts), its peak RSS stays
under 75% of its limit, no probe fails as often in a row as the kubelet's threshold
(3; each has 5 s), and the other client gets 200 for every request (except in the
``global`` phase, where many addresses fill the whole connection cap on purpose: there
the bound on memory is what is asserted). The attacker is answered as the design says:
refused past its connections, 429 past its body share, large answers passed through
whole.
"""

from __future__ import annotations

from pathlib import Path

from e2e.front_door import MIB, PHASES, run


def test_one_hostile_client_neither_starves_the_router_nor_runs_it_out_of_memory(
    tmp_path: Path,
) -> None:
    result = run(tmp_path)
    report = "\n".join(r.line() for r in result.results)
    print(f"limit {result.limit // MIB} MiB ({result.how})\n{report}")
    assert [r.phase for r in result.results] == list(PHASES), report
    assert "Traceback" not in result.log, result.log[-4000:]
    for r in result.results:
        assert r.alive, f"{r.phase}: the router died\n{report}\n{result.log[-3000:]}"
        assert r.rss_peak < 0.75 * result.limit, f"{r.phase}: over 75% of the limit\n{report}"
        assert r.probes, report
        assert r.probe_streak < 3, (
            f"{r.phase}: probes failed {r.probe_streak} times in a row\n{report}"
        )
        if r.phase != "global":
            assert set(r.good) == {"200"}, f"{r.phase}: the other client was refused\n{report}"
            assert r.good["200"] >= 5, report
    by = {r.phase: r for r in result.results}
    assert by["connections"].attacker["HTTP/1.1 503 Service Unavailable"] > 0, report
    assert by["connections"].attacker["closed"] > 0, report  # the head deadline
    assert by["heads"].attacker["closed"] > 0, report
    for phase in ("unfinished-bodies", "complete-bodies"):
        assert by[phase].attacker["429"] > 0, report  # past its share, before being read
    assert by["large-answers"].attacker["200:whole"] > 0, report
    assert by["global"].attacker["HTTP/1.1 503 Service Unavailable"] > 0, report
