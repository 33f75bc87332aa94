"""Each of the chart's alerts, unit-tested by Prometheus's own rule tester (``promtool test
rules``, built with the test bed's Prometheus) on the shipped rule file, with its real
``for``: the alert fires for series that show its fault and stays silent for series of a
healthy pool, and no other alert fires for either. The kind test bed induces the faults it
can on real pods (tests/kind/test_autoscaling.py); the series here are the same metrics,
written by hand, so every rule is covered, the ones a test bed cannot induce included."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.kind.monitoring import tools_dir
from encoderpool_codegen.monitoring import ALERTS
from encoderpool_contracts.signals import DISPATCH_DECISIONS
from tests.chart.fixtures import CHART

NS, POOL = "team-a", "vl"
AT = f'namespace="{NS}",pool="{POOL}"'
MINUTES = 90  # samples a minute apart: past every rule's `for` and rate window


@dataclass(frozen=True)
class Case:
    """Series (name{labels} -> promtool's expanding notation) for one alert."""

    fault: dict[str, str]
    healthy: dict[str, str]


def _condition(condition: str, status: str, reason: str) -> str:
    return (
        f"encoderpool_operator_pool_condition{{{AT},condition={json.dumps(condition)},"
        f"status={json.dumps(status)},reason={json.dumps(reason)}}}"
    )


def _volume(bytes_left: int, files_left: int) -> dict[str, str]:
    pod = f'{AT},pod="{POOL}-consumer-0"'
    return {
        f"encoderpool_ec_volume_size_bytes{{{pod}}}": f"1000x{MINUTES}",
        f"encoderpool_ec_volume_available_bytes{{{pod}}}": f"{bytes_left}x{MINUTES}",
        f"encoderpool_ec_volume_files{{{pod}}}": f"1000x{MINUTES}",
        f"encoderpool_ec_volume_files_available{{{pod}}}": f"{files_left}x{MINUTES}",
    }


def _counter(per_minute: int) -> str:
    return f"0+{per_minute}x{MINUTES}"


ROUTER = f'{AT},pod="{POOL}-router-0"'
CASES: dict[str, Case] = {
    "EncoderPoolNoConsumerReady": Case(
        {f'encoderpool_router_backends{{{ROUTER},role="consumer"}}': f"0x{MINUTES}"},
        {f'encoderpool_router_backends{{{ROUTER},role="consumer"}}': f"1x{MINUTES}"},
    ),
    "EncoderPoolProducersFailing": Case(
        {
            f'encoderpool_router_errors_total{{{ROUTER},kind="producer_timeout"}}': _counter(3),
            f'encoderpool_router_media_items_total{{{ROUTER},where="remote"}}': _counter(10),
        },
        {
            # A refused item is the client's, not a failing producer.
            f'encoderpool_router_errors_total{{{ROUTER},kind="producer_refused_item"}}': (
                _counter(5)
            ),
            f'encoderpool_router_errors_total{{{ROUTER},kind="producer_error"}}': _counter(1),
            f'encoderpool_router_media_items_total{{{ROUTER},where="remote"}}': _counter(10),
        },
    ),
    "EncoderPoolLocalEncodeFallbackHigh": Case(
        {
            f'{DISPATCH_DECISIONS}{{{ROUTER},reason="no_producer"}}': _counter(6),
            f'{DISPATCH_DECISIONS}{{{ROUTER},reason="least_loaded"}}': _counter(4),
        },
        {
            f'{DISPATCH_DECISIONS}{{{ROUTER},reason="no_producer"}}': _counter(1),
            f'{DISPATCH_DECISIONS}{{{ROUTER},reason="least_loaded"}}': _counter(10),
        },
    ),
    "EncoderPoolCacheEvicting": Case(
        {f'encoderpool_ec_evicted_bytes_total{{{AT},pod="p"}}': _counter(1000)},
        {f'encoderpool_ec_evicted_bytes_total{{{AT},pod="p"}}': f"5000x{MINUTES}"},
    ),
    "EncoderPoolWidthMeasurementFailing": Case(
        # A failed width Job is also Stalled; only the width alert speaks of it.
        {
            _condition("WidthsMeasured", "False", "WidthJobFailed"): f"1x{MINUTES}",
            _condition("Stalled", "True", "WidthJobFailed"): f"1x{MINUTES}",
        },
        {
            _condition("WidthsMeasured", "True", "Measured"): f"1x{MINUTES}",
            _condition("Stalled", "False", "Measured"): f"1x{MINUTES}",
        },
    ),
    "EncoderPoolStalled": Case(
        {_condition("Stalled", "True", "NameConflict"): f"1x{MINUTES}"},
        # Still measuring is progress, not a stall.
        {_condition("WidthsMeasured", "False", "Measuring"): f"1x{MINUTES}"},
    ),
    "EncoderPoolCacheVolumeNearlyFull": Case(_volume(50, 500), _volume(500, 500)),
    "EncoderPoolRouter5xx": Case(
        {
            f'encoderpool_router_requests_total{{{ROUTER},code="503"}}': _counter(1),
            f'encoderpool_router_requests_total{{{ROUTER},code="200"}}': _counter(10),
        },
        {
            f'encoderpool_router_requests_total{{{ROUTER},code="429"}}': _counter(5),
            f'encoderpool_router_requests_total{{{ROUTER},code="200"}}': _counter(100),
        },
    ),
}


def test_every_alert_has_a_case() -> None:
    assert sorted(CASES) == sorted(a.name for a in ALERTS)


def _summary(template: str) -> str:
    return template.replace("{{ $labels.namespace }}", NS).replace("{{ $labels.pool }}", POOL)


def _group(series: dict[str, str], firing: str | None) -> dict[str, object]:
    """One promtool test: ``series`` in, every alert checked at the end (only ``firing``)."""
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [
            {
                "eval_time": f"{MINUTES - 1}m",
                "alertname": a.name,
                "exp_alerts": (
                    [
                        {
                            "exp_labels": {"namespace": NS, "pool": POOL, "severity": a.severity},
                            "exp_annotations": {"summary": _summary(a.summary)},
                        }
                    ]
                    if a.name == firing
                    else []
                ),
            }
            for a in ALERTS
        ],
    }


@pytest.fixture(scope="module")
def promtool() -> Path:
    return tools_dir() / "promtool"


@pytest.mark.parametrize("alert", sorted(CASES))
@pytest.mark.parametrize("state", ["fault", "healthy"])
def test_the_alert_fires_for_its_fault_and_is_silent_when_healthy(
    promtool: Path, tmp_path: Path, alert: str, state: str
) -> None:
    case = CASES[alert]
    series, firing = (case.fault, alert) if state == "fault" else (case.healthy, None)
    (tmp_path / "alerts.yml").write_text((CHART / "files" / "alerts.json").read_text())
    tests = {"rule_files": ["alerts.yml"], "tests": [_group(series, firing)]}
    (tmp_path / "tests.yml").write_text(json.dumps(tests))  # JSON is YAML
    proc = subprocess.run(
        [str(promtool), "test", "rules", "tests.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
