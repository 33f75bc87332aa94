"""The operator's rendered command lines, read by the vLLM importable here: `vllm serve`'s
own parser for every producer and consumer Deployment of the example pools, and the
width Job's measure program down to the ``EngineArgs`` it builds. The venv's 0.32 in the
main suite; each supported release's modules when ``test_vllm_releases`` runs this module
with the release ahead on the path. A flag vLLM renames or removes fails here, named."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
from collections.abc import Callable
from typing import Any

import pytest

from encoderpool_connector.programs import measure
from encoderpool_contracts import ConnectorConfig
from encoderpool_contracts.pod import MEASURE_MODULE
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.render.widths import report_key, width_job
from tests.operator.fixtures import children, load

EXAMPLES = ("pool-shared-volume.yaml", "pool-rdma.yaml", "pool-producer-groups.yaml")


def _make_arg_parser() -> Callable[[Any], Any]:
    """vLLM's builder of the `serve` options, where the release keeps it: 0.32 in
    ``vllm.entrypoints.launchers.cli_args``, 0.33 on in ``vllm.entrypoints.common.cli_args``.
    In neither place this fails, naming both."""
    places = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args")
    for module in places:
        try:
            found: Callable[[Any], Any] = importlib.import_module(module).make_arg_parser
            return found
        except (ImportError, AttributeError):
            continue
    raise AssertionError(f"vLLM's make_arg_parser is in none of {places}")


@pytest.fixture(scope="module")
def serve_parser() -> argparse.ArgumentParser:
    """`vllm`'s parser with its `serve` subcommand, built as ``ServeSubcommand.subparser_init``
    builds it (vllm/entrypoints/cli/serve.py), without importing the server that module
    starts: from 0.34 on it needs packages the 0.32 venv does not have (orjson)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser: argparse.ArgumentParser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    _make_arg_parser()(subparsers.add_parser("serve", usage="vllm serve [model_tag] [options]"))
    return parser


def _vllm_containers() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for example in EXAMPLES:
        for key, obj in children(load(example)).items():
            if obj["kind"] != "Deployment":
                continue
            for c in obj["spec"]["template"]["spec"]["containers"]:
                if c.get("command") == ["vllm"]:
                    out.append((f"{example}:{key}", c))
    return out


CONTAINERS = _vllm_containers()


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    """``args`` as `vllm` parses them; AssertionError with vLLM's own message if it refuses."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"vLLM's parser refuses the rendered args: {err.getvalue()}") from e


def test_the_examples_render_producers_and_consumers() -> None:
    roles = {json.loads(c["args"][c["args"].index("--ec-transfer-config") + 1])["ec_role"]
             for _, c in CONTAINERS}  # fmt: skip
    assert roles == {"ec_producer", "ec_consumer"}
    assert len(CONTAINERS) == 7


@pytest.mark.parametrize("container", [c for _, c in CONTAINERS], ids=[n for n, _ in CONTAINERS])
def test_vllm_serve_parses_each_rendered_command_line(
    serve_parser: argparse.ArgumentParser, container: dict[str, Any]
) -> None:
    args: list[str] = container["args"]
    assert args[0] == "serve"
    ns = _parse(serve_parser, args)
    rendered_ec = json.loads(args[args.index("--ec-transfer-config") + 1])
    ec = ns.ec_transfer_config
    assert (ec.ec_connector, ec.ec_role, ec.ec_connector_module_path) == (
        rendered_ec["ec_connector"],
        rendered_ec["ec_role"],
        rendered_ec["ec_connector_module_path"],
    )
    # The connector's config arrives whole, and parses as the connector will parse it.
    assert ec.ec_connector_extra_config == rendered_ec["ec_connector_extra_config"]
    ConnectorConfig.from_extra_config(ec.ec_connector_extra_config)
    assert ns.model_tag == args[1]
    assert ns.port == int(args[args.index("--port") + 1])
    assert ns.tensor_parallel_size == int(args[args.index("--tensor-parallel-size") + 1])
    assert ns.middleware == [args[i + 1] for i, a in enumerate(args) if a == "--middleware"]
    assert ns.limit_mm_per_prompt == json.loads(args[args.index("--limit-mm-per-prompt") + 1])


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_width_job_s_engine_arguments_exist_in_vllm(example: str) -> None:
    """The width Job runs our measure program, which starts vLLM with ``EngineArgs`` built
    from its flags: each keyword must be an ``EngineArgs`` field, its EC config an
    ``ECTransferConfig``, and the connector it names one of vLLM's built-in ones."""
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.engine.arg_utils import EngineArgs

    pool: EncoderPool = load(example)
    identity = pool.spec.model_identity(pool.spec.image)
    job = width_job(pool, identity, report_key(pool))
    container = job["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[:2] == ["-m", MEASURE_MODULE]
    kw = measure.engine_kwargs(measure.parse_args(args[2:]), "/nonexistent")
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert sorted(set(kw) - fields) == [], "EngineArgs no longer takes these keywords"
    ec = ECTransferConfig(**kw["ec_transfer_config"])
    assert ec.ec_role == "ec_producer"
    assert ec.ec_connector in ECConnectorFactory._registry, (
        f"vLLM no longer registers {ec.ec_connector}, which the width Job uses"
    )
