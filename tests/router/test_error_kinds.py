"""Every error kind the router counts is pre-created: a kind missing from ``ERROR_KINDS``
turns the refusal it counts into a 500 (the label lookup fails)."""

from __future__ import annotations

import ast
from pathlib import Path

from encoderpool_router.metrics import ERROR_KINDS

ROUTER = Path(__file__).resolve().parents[2] / "router" / "encoderpool_router"
# Where the kind counted is a string literal: Refused(status, message, type, kind),
# over_share(message, kind), invalid(message, kind), metrics.error(kind), UpstreamError(kind).
_KIND_ARG = {"Refused": 3, "over_share": 1, "invalid": 1, "error": 0, "UpstreamError": 0}


def counted_kinds() -> set[str]:
    kinds = set()
    for path in ROUTER.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            at = _KIND_ARG.get(name)
            if at is not None and len(node.args) > at:
                arg = node.args[at]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    kinds.add(arg.value)
    return kinds


def test_every_kind_counted_is_pre_created() -> None:
    kinds = counted_kinds()
    assert {"client_body_memory", "body_memory_full", "body_memory", "bad_request"} <= kinds
    assert kinds - set(ERROR_KINDS) == set()
