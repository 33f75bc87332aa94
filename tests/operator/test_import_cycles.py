"""No two of the operator's modules import each other, directly or round about, not even
for type hints only: a shared piece belongs in a module both import."""

from __future__ import annotations

import ast
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[2] / "operator"


def _modules() -> dict[str, Path]:
    out = {}
    for path in OPERATOR.rglob("*.py"):
        parts = list(path.relative_to(OPERATOR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (``from pkg import submodule`` counts
    as the submodule)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if (sub := f"{node.module}.{alias.name}") in modules:
                        edges[module].add(sub)
                    elif node.module in modules:
                        edges[module].add(node.module)
            elif isinstance(node, ast.Import):
                edges[module] |= {a.name for a in node.names if a.name in modules}
    return edges


def _cycle_from(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from ``start`` back to itself, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        module, path = stack.pop()
        for target in sorted(edges[module]):
            if target == start:
                return [*path, start]
            if target not in seen:
                seen.add(target)
                stack.append((target, [*path, target]))
    return None


def test_the_operator_s_modules_import_no_cycle() -> None:
    edges = _imports(_modules())
    assert len(edges) > 40  # the package was found
    cycles = [c for m in sorted(edges) if (c := _cycle_from(m, edges))]
    assert cycles == []
