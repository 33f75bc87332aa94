"""spec.model.extraArgs cannot override the flags the operator renders, in any spelling
vLLM's own parser accepts: checked with the parser `vllm serve` builds (vLLM 0.32).

The extra args are rendered last, and vLLM's parser takes unambiguous prefixes, `_` for
`-`, `--flag=value` and dotted JSON keys (appended after everything else): each hostile
spelling below really overrides the operator's value when rendered, so the spec
refuses every one of them (CEL in the CRD runs the same pattern)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import pytest
import yaml

from encoderpool_contracts.pod import HTTP_PORT
from encoderpool_operator.api import EncoderPool
from encoderpool_operator.api.model import OWNED_FLAGS, OWNED_FLAGS_PATTERN, OWNED_SHORT_FLAGS
from encoderpool_operator.naming import CONSUMER
from encoderpool_operator.render.vllm import vllm_args
from tests.operator.fixtures import REPO


@pytest.fixture(scope="module")
def vllm_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(`vllm`'s parser, its `serve` subparser), built as vllm/entrypoints/cli/main.py does."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand().subparser_init(subparsers)
    return parser, serve


def _pool(extra_args: list[str] | None = None) -> dict[str, Any]:
    obj = yaml.safe_load((REPO / "examples" / "pool-shared-volume.yaml").read_text())
    obj["metadata"] = {"name": "pool", "namespace": "ml", "uid": "u"}
    if extra_args is not None:
        obj["spec"]["model"]["extraArgs"] = extra_args
    return dict(obj)


def _rendered(obj: dict[str, Any]) -> list[str]:
    """The consumer's `vllm serve` args, rendered without validating ``obj`` (as if a
    hostile spec had got past the checks), the user's extras last as always."""
    valid = EncoderPool.from_object(_pool())
    model = valid.spec.model.model_copy(
        update={"extra_args": tuple(obj["spec"]["model"]["extraArgs"])}
    )
    pool = valid.model_copy(update={"spec": valid.spec.model_copy(update={"model": model})})
    config = pool.spec.connector_config("0" * 16, {"image": 128})
    return vllm_args(pool, CONSUMER, config)


def _owned_values(parser: argparse.ArgumentParser, args: list[str]) -> dict[str, Any]:
    ns = parser.parse_args(args)
    ec = ns.ec_transfer_config
    return {
        "model": ns.model_tag,
        "host": ns.host,
        "port": ns.port,
        "dtype": ns.dtype,
        "tensor_parallel_size": ns.tensor_parallel_size,
        "ec_connector": ec.ec_connector,
        "ec_role": ec.ec_role,
        "ec_module": ec.ec_connector_module_path,
    }


def test_the_rendered_args_give_vllm_the_operator_s_values(vllm_parser: Any) -> None:
    parser, _ = vllm_parser
    got = _owned_values(parser, _rendered(_pool()))
    assert got == {
        "model": EncoderPool.from_object(_pool()).spec.model.path(),
        "host": "0.0.0.0",  # noqa: S104 (what the pods listen on)
        "port": HTTP_PORT,
        "dtype": "bfloat16",
        "tensor_parallel_size": 1,
        "ec_connector": "EncoderPoolSharedVolumeConnector",
        "ec_role": "ec_consumer",
        "ec_module": "encoderpool_connector.shared_volume",
    }


EVIL_EC = json.dumps({"ec_connector": "Evil", "ec_role": "ec_producer"})
HOSTILE: list[tuple[str, list[str], str]] = [
    ("prefix", ["--ec-transfer-conf", EVIL_EC], "ec_connector"),
    ("prefix-equals", [f"--ec-transfer={EVIL_EC}"], "ec_connector"),
    ("underscores", ["--ec_transfer_config", EVIL_EC], "ec_connector"),
    ("dotted-key", ["--ec-transfer-config.ec_role", "ec_producer"], "ec_role"),
    ("dotted-prefix", ["--ec_transfer_conf.ec_connector_module_path", "evil"], "ec_module"),
    ("host-prefix", ["--hos", "10.0.0.1"], "host"),
    ("port-equals", ["--port=9999"], "port"),
    ("dtype-prefix", ["--dty", "float32"], "dtype"),
    ("short-tp", ["-tp", "2"], "tensor_parallel_size"),
    ("short-t", ["-t", "2"], "tensor_parallel_size"),
    ("short-tp-equals", ["-tp=2"], "tensor_parallel_size"),
]


@pytest.mark.parametrize(("case", "extra", "field"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_each_spelling_vllm_accepts_would_override_and_is_refused(
    vllm_parser: Any, case: str, extra: list[str], field: str
) -> None:
    parser, _ = vllm_parser
    ours = _owned_values(parser, _rendered(_pool()))
    theirs = _owned_values(parser, _rendered(_pool(extra)))
    assert theirs[field] != ours[field], f"{case}: vLLM did not take {extra[0]!r}"
    with pytest.raises(ValueError, match=r"spec\.model\.extraArgs") as info:
        EncoderPool.from_object(_pool(extra))
    assert "spells a flag the operator sets" in str(info.value)


def _normalised(arg: str) -> str:
    """What vLLM's parse_args hands argparse for one `--` argument (`_` -> `-` in the name)."""
    if not arg.startswith("--"):
        return arg
    key, eq, value = arg.partition("=")
    key = re.sub(r"(?<=--)[^.]*", lambda m: m.group(0).replace("_", "-"), key, count=1)
    return key + eq + value


def _resolves_to(serve: argparse.ArgumentParser, arg: str) -> str | None:
    """The dest argparse gives ``arg`` (an abbreviation included), None if none or ambiguous."""
    try:
        found = serve._parse_optional(_normalised(arg).split(".", 1)[0])
    except (SystemExit, Exception):  # vLLM's error() raises on an ambiguous prefix
        return None
    if not found or found[0] is None:
        return None
    return str(found[0].dest)


def test_every_prefix_the_real_parser_maps_to_an_owned_flag_is_refused(vllm_parser: Any) -> None:
    _, serve = vllm_parser
    owned = {
        action.dest
        for action in serve._actions
        if any(o.lstrip("-") in (*OWNED_FLAGS, *OWNED_SHORT_FLAGS) for o in action.option_strings)
    }
    assert len(owned) == len(OWNED_FLAGS)  # each named flag exists in this vLLM
    checked = 0
    for action in serve._actions:
        if action.dest not in owned:
            continue
        for option in action.option_strings:
            dashes = "--" if option.startswith("--") else "-"
            name = option.removeprefix(dashes)
            for n in range(1, len(name) + 1):
                for stem in {name[:n], name[:n].replace("-", "_")}:
                    for arg in (dashes + stem, f"{dashes}{stem}=1", f"{dashes}{stem}.k"):
                        if _resolves_to(serve, arg) == action.dest:
                            checked += 1
                            assert re.match(OWNED_FLAGS_PATTERN, arg), arg
    assert checked > 100


def test_no_flag_of_vllm_that_the_operator_does_not_set_is_refused(vllm_parser: Any) -> None:
    _, serve = vllm_parser
    owned = {*(f"--{f}" for f in OWNED_FLAGS), *(f"-{f}" for f in OWNED_SHORT_FLAGS)}
    free = [
        o
        for action in serve._actions
        for o in action.option_strings
        if not any(p in owned for p in action.option_strings) and o not in ("-h", "--help")
    ]
    assert len(free) > 100
    for option in free:
        for arg in (option, f"{option}=1", option.replace("-", "_").replace("__", "--", 1)):
            assert not re.match(OWNED_FLAGS_PATTERN, arg), arg
    EncoderPool.from_object(_pool(["--max-model-len", "2048", "--config-format", "auto"]))
