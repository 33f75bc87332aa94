"""The architecture's import rules (tools/import_rules.py) on planted trees and on ours."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _rules() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "import_rules", ROOT / "tools" / "import_rules.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_rules"] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


rules = _rules()


def plant(root: Path, path: str, text: str) -> None:
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    for parent in file.relative_to(root).parents:
        if len(parent.parts) > 1:  # the package folders, not the top-level plain folder
            (root / parent / "__init__.py").touch()
    file.write_text(text)


@pytest.mark.parametrize(
    ("path", "text", "rule"),
    [
        ("contracts/encoderpool_contracts/x.py", "import encoderpool_router\n", "contracts"),
        (
            "operator/encoderpool_operator/x.py",
            "from encoderpool_connector.programs import api_guard\n",
            "operator",
        ),
        ("operator/encoderpool_operator/x.py", "def f() -> None:\n    import torch\n", "operator"),
        ("router/encoderpool_router/x.py", "import encoderpool_operator.api\n", "router"),
        ("connector/encoderpool_connector/x.py", "import kopf\n", "connector"),
        (
            "connector/encoderpool_connector/rdma/x.py",
            "from ..shared_volume.entry import Header\n",
            "transports",
        ),
        (
            "connector/encoderpool_connector/shared_volume/x.py",
            "from encoderpool_connector.rdma import auth\n",
            "transports",
        ),
        (
            "connector/encoderpool_connector/core/x.py",
            "def f() -> None:\n    from encoderpool_connector.shared_volume import store\n",
            "core",
        ),
        ("connector/encoderpool_connector/core/x.py", "from ..rdma import buffer\n", "core"),
        (
            "connector/encoderpool_connector/core/x.py",
            "from encoderpool_connector.programs.measure import main\n",
            "core",
        ),
        (
            "connector/encoderpool_connector/rdma/x.py",
            "from ..programs import api_guard\n",
            "transport-program",
        ),
        (
            "connector/encoderpool_connector/programs/x.py",
            "import encoderpool_connector.shared_volume.entry\n",
            "program-transport",
        ),
        (
            "connector/encoderpool_connector/programs/api_guard.py",
            "from ..core import stats\n",
            "api-guard",
        ),
        (
            "connector/encoderpool_connector/programs/volume_metrics.py",
            "def f() -> None:\n    from vllm.v1.metrics import prometheus\n",
            "volume-metrics",
        ),
        (
            "connector/encoderpool_connector/programs/volume_metrics.py",
            "from ..core.startup import check\n",
            "volume-metrics-core",
        ),
        (
            "connector/encoderpool_connector/programs/vllm_cache.py",
            "from encoderpool_contracts import DTYPE_BYTES\n",
            "vllm-cache",
        ),
        (
            "operator/encoderpool_operator/render/x.py",
            "from encoderpool_operator.reconcile.observe import Snapshot\n",
            "render-reconcile",
        ),
        (
            "operator/encoderpool_operator/render/x.py",
            "def f() -> None:\n    from ..kube import Kube\n",
            "render-kube",
        ),
        ("operator/encoderpool_operator/render/__init__.py", "import kopf\n", "render-kopf"),
        ("operator/encoderpool_operator/naming.py", "from .cache import Reader\n", "naming-cache"),
        (
            "operator/encoderpool_operator/naming.py",
            "from encoderpool_operator.controller import events\n",
            "naming-controller",
        ),
        (
            "operator/encoderpool_operator/naming.py",
            "import encoderpool_operator.handlers\n",
            "naming-handlers",
        ),
        (
            "operator/encoderpool_operator/reconcile/x.py",
            "from ..controller.manager import Controller\n",
            "reconcile-controller",
        ),
        (
            "operator/encoderpool_operator/reconcile/x.py",
            "from encoderpool_operator import handlers\n",
            "reconcile-handlers",
        ),
        (
            "operator/encoderpool_operator/controller/x.py",
            "def f() -> None:\n    import kopf\n",
            "controller-kopf",
        ),
    ],
    ids=[
        "contracts",
        "operator",
        "operator-lazy",
        "router",
        "connector",
        "relative",
        "absolute",
        "core-transport-lazy",
        "core-transport-relative",
        "core-program",
        "transport-program",
        "program-transport",
        "api-guard",
        "volume-metrics",
        "volume-metrics-core",
        "vllm-cache",
        "render-reconcile",
        "render-kube",
        "render-kopf",
        "naming-cache",
        "naming-controller",
        "naming-handlers",
        "reconcile-controller",
        "reconcile-handlers",
        "controller-kopf",
    ],
)
def test_a_planted_violation_is_named(tmp_path: Path, path: str, text: str, rule: str) -> None:
    plant(tmp_path, path, text)
    found = rules.violations(tmp_path)
    assert len(found) == 1, found
    assert found[0].startswith(path + ":")


def test_allowed_imports_pass(tmp_path: Path) -> None:
    plant(tmp_path, "connector/encoderpool_connector/rdma/x.py", "from ..core import y\n")
    plant(
        tmp_path,
        "connector/encoderpool_connector/programs/measure.py",
        "from encoderpool_connector.core import startup\nimport encoderpool_contracts\n",
    )
    plant(
        tmp_path,
        "connector/encoderpool_connector/programs/api_guard.py",
        "from encoderpool_contracts.pod import API_GUARD_MIDDLEWARE\n",
    )
    plant(
        tmp_path,
        "connector/encoderpool_connector/programs/volume_metrics.py",
        "from prometheus_client import REGISTRY\nfrom encoderpool_contracts import pod\n",
    )
    plant(
        tmp_path,
        "connector/encoderpool_connector/shared_volume/x.py",
        "import encoderpool_contracts\n",
    )
    plant(tmp_path, "router/encoderpool_router/x.py", "from encoderpool_contracts import pod\n")
    plant(tmp_path, "operator/encoderpool_operator/x.py", "import kopf\n")
    plant(
        tmp_path,
        "operator/encoderpool_operator/render/x.py",
        "from encoderpool_operator.naming import child_meta\nfrom ..api import EncoderPool\n",
    )
    plant(
        tmp_path,
        "operator/encoderpool_operator/reconcile/x.py",
        "from ..render import Defaults\nfrom encoderpool_operator.kube import Kube\n",
    )
    plant(
        tmp_path,
        "operator/encoderpool_operator/controller/x.py",
        "from ..reconcile import reconcile\nfrom kubernetes import client\n",
    )
    assert rules.violations(tmp_path) == []


def test_the_tree_keeps_the_rules() -> None:
    assert rules.violations(ROOT) == []
