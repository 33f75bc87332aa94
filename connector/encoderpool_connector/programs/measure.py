"""The width Job: measure a model's encoder outputs the way the pool will serve it.

    python -m encoderpool_connector.programs.measure --model /models/x
        [--dtype bfloat16] [--tensor-parallel-size N] [--limit-mm-per-prompt JSON]
        [--revision R] --output-file report.json
    python -m encoderpool_connector.programs.measure --identity <ModelIdentity JSON>
        [--max-model-len N] --output-file /dev/termination-log   # as the width Job runs it

It starts the engine as an EC producer (encoder only, no KV cache), which
makes vLLM encode a dummy item per modality and record each width, exactly as
a producer pod does at start-up. It then encodes each dummy item once more and
times it (``encode_timing``: the warm encode a producer pays per item, on the
Job's CPU or GPU). It adds the LM hidden size, dtype, bytes per token and the
most tokens one item can produce, fingerprints the model as served, and writes
a ``WidthReport`` as compact JSON to ``--output-file``. In the Job that file is
the container's termination message, which the operator reads and stores in the
report's ConfigMap: the Job needs no API access. Exit codes: 0 ok, 2 bad
arguments or model, 3 no multimodal encoder, 4 the report cannot be written
(larger than the kubelet's 4096-byte termination message, or the file is not
writable).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from encoderpool_connector.programs.encode_timing import encode_seconds, time_encodes_on_worker
from encoderpool_contracts import DTYPE_BYTES, ModelIdentity, WidthReport
from encoderpool_contracts.pod import MEASURE_MODULE

logger = logging.getLogger("vllm.ext." + __name__)


class MeasureError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MEASURE_MODULE}", description=__doc__)
    p.add_argument(
        "--identity",
        type=ModelIdentity.model_validate_json,
        default=None,
        help="The model as the operator will serve it (report.ModelIdentity JSON): it sets "
        "model, revision, dtype, parallelism and limits, and keys the report, so the operator "
        "finds it under the fingerprint it computed. Its vllm_version names the serving image.",
    )
    p.add_argument("--model", default=None, help="Model path or name, as given to vllm serve.")
    p.add_argument("--revision", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--limit-mm-per-prompt", type=json.loads, default=None, help="JSON, as vLLM.")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.3,
        help="vLLM's flag; low by default: measuring needs the weights and one dummy item only.",
    )
    p.add_argument(
        "--output-file",
        type=Path,
        default=None,
        help="Write the report here as compact JSON (in the Job: /dev/termination-log).",
    )
    args = p.parse_args(argv)
    if args.output_file is None:
        p.error("give --output-file (the width Job: --output-file /dev/termination-log)")
    if args.identity is not None:
        if args.model is not None:
            p.error("give --identity or --model, not both")
        ident: ModelIdentity = args.identity
        args.model = ident.model
        args.revision = ident.revision or None
        args.dtype = ident.dtype
        args.tensor_parallel_size = ident.tensor_parallel_size
        args.pipeline_parallel_size = ident.pipeline_parallel_size
        args.limit_mm_per_prompt = dict(ident.limit_mm_per_prompt) or None
    elif args.model is None:
        p.error("give --model (or --identity)")
    return args


def engine_kwargs(args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    """What the pool's producers pass to vLLM, as an encoder-only producer."""
    kw: dict[str, Any] = {
        "model": args.model,
        "revision": args.revision,
        "dtype": args.dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "enforce_eager": True,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "trust_remote_code": args.trust_remote_code,
        # vLLM measures widths only for EC producers; the example connector writes
        # nothing unless asked to encode, and never here.
        "ec_transfer_config": {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_producer",
            "ec_connector_extra_config": {"shared_storage_path": scratch},
        },
    }
    if args.limit_mm_per_prompt is not None:
        kw["limit_mm_per_prompt"] = args.limit_mm_per_prompt
    if args.max_model_len is not None:
        kw["max_model_len"] = args.max_model_len
    return kw


def check_model(args: argparse.Namespace, kw: dict[str, Any]) -> Any:
    """The model config, or MeasureError for a missing model or one without an encoder."""
    looks_local = args.model.startswith(("/", "./", "../", "~"))
    if looks_local and not Path(args.model).expanduser().exists():
        raise MeasureError(2, f"--model: {args.model} does not exist")
    from vllm.engine.arg_utils import EngineArgs

    plain = {k: v for k, v in kw.items() if k != "ec_transfer_config"}
    try:
        # Without the EC config: vLLM's own message for a text-only producer is less clear.
        model_config = EngineArgs(**plain).create_model_config()
    except Exception as e:
        raise MeasureError(2, f"--model: vLLM cannot load {args.model}: {e}") from None
    if not model_config.is_multimodal_model:
        raise MeasureError(
            3, f"--model: {args.model} has no multimodal encoder; there is nothing to measure"
        )
    return model_config


def agreed_identity(given: ModelIdentity, served: ModelIdentity) -> ModelIdentity:
    """The operator's identity, once the engine confirms it served exactly that."""
    if problems := given.differences(served):
        raise MeasureError(2, "--identity: " + "; ".join(problems))
    return given


def measure(args: argparse.Namespace) -> WidthReport:
    # In-process engine core: vLLM records the widths on the very config we hold.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with tempfile.TemporaryDirectory(prefix="ep-measure-") as scratch:
        kw = engine_kwargs(args, scratch)
        check_model(args, kw)
        from vllm import LLM
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.multimodal.encoder_budget import MultiModalBudget

        from encoderpool_contracts import identity_from_vllm_config

        try:
            llm = LLM(**kw)
        except Exception as e:
            raise MeasureError(2, f"vLLM could not start {args.model}: {e}") from None
        vllm_config = llm.llm_engine.vllm_config
        widths = dict(vllm_config.ec_transfer_config.mm_encoder_output_widths or {})
        if not widths:
            from vllm.distributed.ec_transfer.ec_connector.encoder_output_width import (
                _measure_on_worker,
            )

            reports = [w for w in llm.collective_rpc(_measure_on_worker) if w]
            widths = dict(reports[0]) if reports else {}
        if not widths:
            raise MeasureError(3, f"--model: {args.model} encoded no dummy multimodal item")
        seconds = timed_encodes(llm, widths)
        budget = MultiModalBudget(vllm_config, MULTIMODAL_REGISTRY, enable_cache=False)
        max_tokens = {m: int(n) for m, n in budget.mm_max_toks_per_item.items() if m in widths}
        identity = identity_from_vllm_config(vllm_config)
        if args.identity is not None:
            identity = agreed_identity(args.identity, identity)
        elem = DTYPE_BYTES[identity.dtype]
        return WidthReport(
            fingerprint=identity.fingerprint(),
            identity=identity,
            encoder_output_widths={m: int(w) for m, w in widths.items()},
            hidden_size=int(vllm_config.model_config.get_hidden_size()),
            dtype=identity.dtype,
            bytes_per_token={m: int(w) * elem for m, w in widths.items()},
            max_tokens_per_item=max_tokens,
            measured_at=datetime.now(timezone.utc),
            encode_seconds=seconds,
        )


def timed_encodes(llm: Any, widths: dict[str, int]) -> dict[str, float]:
    """One warm encode per measured modality, timed; {} (and a warning) if it fails.

    The widths are what the pool needs to start; the time only informs sizing, so a
    failure here leaves it out of the report rather than failing the Job.
    """
    try:
        seconds = encode_seconds(llm.collective_rpc(time_encodes_on_worker), widths)
    except Exception as e:
        logger.warning("timing one encode per modality failed, the report has none: %s", e)
        return {}
    logger.info("one warm encode per modality took %s s", seconds)
    return seconds


def publish(report: WidthReport, args: argparse.Namespace) -> None:
    """Write the report where ``--output-file`` says; MeasureError(4) if it cannot be."""
    try:
        text = report.to_termination_message()
    except ValueError as e:
        raise MeasureError(4, f"--output-file: {e}") from None
    path: Path = args.output_file
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:
        raise MeasureError(4, f"--output-file: cannot write {path}: {e.strerror}") from None
    print(f"wrote {path} ({len(text.encode())} bytes)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = measure(args)
        publish(report, args)
    except MeasureError as e:
        print(f"encoderpool measure: error: {e}", file=sys.stderr)
        return e.code
    print(report.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
