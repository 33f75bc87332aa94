"""Start-up checks both transports make, so they cannot drift apart.

The config is parsed once, the transport must be the connector's own
(``parse_config``); the configured widths must equal what this engine's encoder
emits, the model vLLM serves should be the one the width report was measured for,
and the widths a scheduler checks items against are merged here, once
(``encoder_widths``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from encoderpool_contracts import TERMINATION_LOG_ENV, ConnectorConfig, WidthMismatch

logger = logging.getLogger("vllm.ext." + __name__)


def parse_config(vllm_config: Any, transport: str, connector: str) -> ConnectorConfig:
    """The connector's config, or ValueError naming the bad ``ec_connector_extra_config`` key."""
    tc = vllm_config.ec_transfer_config
    assert tc is not None
    config = ConnectorConfig.from_extra_config(tc.ec_connector_extra_config)
    if config.transport != transport:
        raise ValueError(
            f"ec_connector_extra_config.transport: {connector} needs {transport!r}, "
            f"got {config.transport!r}"
        )
    return config


def encoder_widths(
    config: ConnectorConfig, vllm_config: Any, *, producer: bool = True
) -> dict[str, int]:
    """The encoder output width per modality a scheduler checks items against: what this
    engine measured (producers do at start-up) and what the config names (the width
    report's), which must agree where both name a modality (else ValueError).

    Also warns when the served model is not the one the config's identity names:
    a warning, because the fingerprint only namespaces cache entries and every
    producer and consumer of a pool gets the same one. The identity carries the
    producers' parallelism (what the width Job measured with), so a consumer's
    own tensor/pipeline parallel sizes are not compared.
    """
    from encoderpool_contracts import identity_from_vllm_config

    tc = vllm_config.ec_transfer_config
    assert tc is not None
    measured = dict(getattr(tc, "mm_encoder_output_widths", None) or {})
    for modality, width in config.encoder_output_widths.items():
        if modality in measured and measured[modality] != width:
            say_width_mismatch(config, measured)
            raise ValueError(
                f"ec_connector_extra_config.encoder_output_widths.{modality}: configured "
                f"{width}, but this model's encoder emits {measured[modality]}; the width "
                "report is stale or for another model: measure again"
            )
    served = identity_from_vllm_config(vllm_config)
    if config.model_identity is not None:
        own = () if producer else ("tensor_parallel_size:", "pipeline_parallel_size:")
        for problem in config.model_identity.differences(served):
            if problem.startswith(own):
                continue
            logger.warning(
                "encoderpool: ec_connector_extra_config.model_identity.%s; the width "
                "report may be for another model",
                problem,
            )
    elif served.fingerprint() != config.model_fingerprint:
        logger.warning(
            "encoderpool: ec_connector_extra_config.model_fingerprint is %s but the served "
            "model %s fingerprints as %s; check that the width report matches",
            config.model_fingerprint,
            served.model_dump_json(),
            served.fingerprint(),
        )
    return {**measured, **config.encoder_output_widths}


def say_width_mismatch(config: ConnectorConfig, measured: dict[str, int]) -> None:
    """Leave the refusal where the operator reads it: the container's termination message,
    at the path ``TERMINATION_LOG_ENV`` names (the operator sets it; unset, nothing is
    written). Best effort: the start fails with the ValueError either way."""
    path = os.environ.get(TERMINATION_LOG_ENV)
    if not path:
        return
    message = WidthMismatch(
        fingerprint=config.model_fingerprint,
        configured=dict(config.encoder_output_widths),
        measured={m: w for m, w in measured.items() if m in config.encoder_output_widths},
    )
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(message.to_termination_message())
    except OSError as e:
        logger.warning("encoderpool: cannot write the width mismatch to %s: %s", path, e)
