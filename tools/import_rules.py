"""The architecture's import rules, checked: the cut between the three images holds.

The operator image, the router image and the vLLM image with the connector upgrade
independently; what crosses between them lives in ``encoderpool_contracts``. So:

- contracts import nothing of ours (every image carries them as they are);
- the operator, its code generator and the router never import the connector (their
  images have no vLLM or torch), nor each other;
- the connector is layered: its core (``encoderpool_connector.core``) imports neither
  transport; the transports (``shared_volume``, ``rdma``) import the core and the
  contracts, never each other (a change in one transport cannot change the other's
  format); the programs beside the connector (``programs``: the width Job, the API
  guard, the volume metrics, the image build's cache filler) are imported by neither
  the core nor a transport, and import no transport themselves;
- the API guard imports only the standard library and the contracts, and the volume
  metrics middleware only those and prometheus_client: vLLM's API server loads each by
  name, in its front-end process, where neither the engine nor our connector is set
  up; the image build's cache filler imports nothing of ours (it runs as a plain
  script before encoderpool is installed);
- the connector never imports kopf or the Kubernetes client (it installs into a vLLM
  image), and the operator and router never import torch or vLLM;
- the operator is layered: what it renders (``render``, ``naming``) is a pure function
  of the pool, so it imports neither the reconciler, the controller, the kopf wiring
  (``handlers``), the cache, the API client (``kube``) nor kopf; the reconciler
  (``reconcile``) never imports the controller or the kopf wiring; and the controller
  (queue, workers, leader election) never imports kopf: ``handlers`` wires kopf to it.

Every ``import`` is read, including those inside functions. Run by tools/checks.sh:
``python tools/import_rules.py [root]``; prints each violation and exits 1 if any.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Rule:
    """Modules under ``source`` may not import modules under any of ``forbidden``."""

    source: str
    forbidden: tuple[str, ...]
    why: str


RULES = (
    Rule(
        "encoderpool_contracts",
        (
            "encoderpool_connector",
            "encoderpool_operator",
            "encoderpool_router",
            "encoderpool_codegen",
        ),
        "contracts import nothing of ours",
    ),
    Rule(
        "encoderpool_operator",
        ("encoderpool_connector", "encoderpool_router", "torch", "vllm"),
        "the operator image has neither the connector nor vLLM",
    ),
    Rule(
        "encoderpool_codegen",
        ("encoderpool_connector", "encoderpool_router", "torch", "vllm"),
        "the code generator builds from the operator's models alone",
    ),
    Rule(
        "encoderpool_router",
        ("encoderpool_connector", "encoderpool_operator", "torch", "vllm", "kopf"),
        "the router image has neither the connector nor the operator",
    ),
    Rule(
        "encoderpool_connector",
        ("encoderpool_operator", "encoderpool_router", "kopf", "kubernetes"),
        "the connector installs into a vLLM image, without the operator's packages",
    ),
    Rule(
        "encoderpool_connector.core",
        (
            "encoderpool_connector.shared_volume",
            "encoderpool_connector.rdma",
            "encoderpool_connector.programs",
        ),
        "the connector's core is what both transports build on: it imports neither",
    ),
    Rule(
        "encoderpool_connector.shared_volume",
        ("encoderpool_connector.rdma", "encoderpool_connector.programs"),
        "transports never import each other, nor the programs",
    ),
    Rule(
        "encoderpool_connector.rdma",
        ("encoderpool_connector.shared_volume", "encoderpool_connector.programs"),
        "transports never import each other, nor the programs",
    ),
    Rule(
        "encoderpool_connector.programs",
        ("encoderpool_connector.shared_volume", "encoderpool_connector.rdma"),
        "the programs are not the connector: they run where no transport is loaded",
    ),
    Rule(
        "encoderpool_connector.programs.api_guard",
        ("encoderpool_connector", "torch", "vllm"),
        "vLLM's API server loads the guard by name: the standard library and the contracts only",
    ),
    Rule(
        "encoderpool_connector.programs.volume_metrics",
        ("encoderpool_connector", "torch", "vllm"),
        "vLLM's API server loads the volume's gauges by name: the standard library, "
        "prometheus_client and the contracts only",
    ),
    Rule(
        "encoderpool_connector.programs.vllm_cache",
        ("encoderpool_connector", "encoderpool_contracts"),
        "the image build runs it as a plain script, before encoderpool is installed",
    ),
    *(
        Rule(
            f"encoderpool_operator.{layer}",
            (
                "encoderpool_operator.reconcile",
                "encoderpool_operator.controller",
                "encoderpool_operator.handlers",
                "encoderpool_operator.cache",
                "encoderpool_operator.kube",
                "kopf",
            ),
            "rendering is a pure function of the pool: no reconciler, cluster or kopf",
        )
        for layer in ("render", "naming")
    ),
    Rule(
        "encoderpool_operator.reconcile",
        ("encoderpool_operator.controller", "encoderpool_operator.handlers"),
        "the reconciler is called by the controller, never the other way",
    ),
    Rule(
        "encoderpool_operator.controller",
        ("kopf",),
        "the controller runs without kopf: handlers.py wires kopf to it",
    ),
)
# Where each top-level package lives in the tree.
PACKAGE_DIRS = ("contracts", "operator", "router", "connector")


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``tree``; relative ones resolved."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return out


def violations(root: Path) -> list[str]:
    found: list[str] = []
    for folder in PACKAGE_DIRS:
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            module = module_name(path, base)
            tree = ast.parse(path.read_text(), filename=str(path))
            seen: set[int] = set()  # one line per import statement
            for line, target in imported(tree, module, path.name == "__init__.py"):
                for rule in RULES:
                    if line in seen or not _under(module, rule.source):
                        continue
                    if any(_under(target, f) for f in rule.forbidden):
                        seen.add(line)
                        where = path.relative_to(root)
                        found.append(f"{where}:{line}: {module} imports {target} ({rule.why})")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    found = violations(root)
    for v in found:
        print(v, file=sys.stderr)
    if found:
        print(f"import rules: {len(found)} violation(s)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
