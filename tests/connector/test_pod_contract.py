"""The pod contract's names resolve in the vLLM image as the operator renders them."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from encoderpool_contracts.pod import API_GUARD_MIDDLEWARE, CONNECTOR_CLASSES, MEASURE_MODULE


@pytest.mark.parametrize("transport", sorted(CONNECTOR_CLASSES))
def test_connector_class_resolves_as_vllm_loads_it(transport: str) -> None:
    """vLLM's factory does getattr(import_module(path), name) and wants an ECConnectorBase."""
    pytest.importorskip("vllm")
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase

    name, module = CONNECTOR_CLASSES[transport]
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, ECConnectorBase)
    assert cls.__name__ == name


def test_measure_module_and_guard_resolve() -> None:
    assert importlib.util.find_spec(MEASURE_MODULE) is not None
    module, _, name = API_GUARD_MIDDLEWARE.rpartition(".")
    assert getattr(importlib.import_module(module), name).__name__ == name
