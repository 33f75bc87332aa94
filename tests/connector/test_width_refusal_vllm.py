"""On the real engine: a producer given a width report its encoder disagrees with refuses
to start, and the reason it leaves as the container's termination message is what the
operator reads back (``reconcile.observe.width_mismatch_of``) and shows on the pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from encoderpool_contracts import (
    CHANNEL_KEY_ENV,
    TERMINATION_LOG_ENV,
    ConnectorConfig,
    WidthMismatch,
)
from encoderpool_operator.naming import VLLM_CONTAINER
from encoderpool_operator.reconcile.observe import width_mismatch_of
from tests.connector.fixtures import TINY_WIDTHS, EpFactory, sv_config, tiny_fingerprint
from tests.connector.shared_volume.fixtures import CHANNEL_KEY

pytestmark = pytest.mark.vllm


def test_a_producer_refusing_the_report_leaves_what_the_operator_reads(
    ep_servers: EpFactory, tiny_model: Path, tmp_path: Path
) -> None:
    stale = {**TINY_WIDTHS, "image": TINY_WIDTHS["image"] * 2}  # as if measured for another model
    extra = ConnectorConfig.from_extra_config(
        sv_config(tmp_path / "cache", tiny_fingerprint(tiny_model))
    ).model_copy(update={"encoder_output_widths": stale})
    log = tmp_path / "termination-log"
    server = ep_servers(
        "refuses",
        role="ec_producer",
        extra=extra.to_extra_config(),
        env={TERMINATION_LOG_ENV: str(log), CHANNEL_KEY_ENV: CHANNEL_KEY},
    )
    assert server.proc is not None
    code = server.proc.wait(timeout=300)
    assert code != 0, "the producer started on a report its encoder disagrees with"
    assert "the width report is stale or for another model" in server.log_text()
    said = WidthMismatch.from_termination_message(log.read_text())
    assert said.configured == stale
    assert said.measured == TINY_WIDTHS  # what vLLM measured at start-up, as the Job does
    pod = {
        "metadata": {"name": "tiny-producer-1"},
        "status": {
            "containerStatuses": [
                {
                    "name": VLLM_CONTAINER,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": code, "message": log.read_text()}},
                }
            ]
        },
    }
    assert width_mismatch_of(pod) == said
    assert (
        said.summary() == f"image: report {stale['image']}, the pod's vLLM {TINY_WIDTHS['image']}"
    )
