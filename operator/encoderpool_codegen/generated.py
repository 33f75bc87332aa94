"""Writing a generated file, or checking that the committed one is current.

Every generator's ``--check`` behaves the same (CI and the tests run it): nothing
written, a diff on stdout and exit 1 when the file differs from a regeneration.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path


def write_or_check(path: Path, text: str, check: bool) -> int:
    """Write ``text`` to ``path`` (0), or with ``check`` compare them: 0 if equal, else
    print the diff and say how to regenerate (1)."""
    if not check:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return 0
    current = path.read_text() if path.exists() else ""
    if current == text:
        return 0
    sys.stdout.writelines(
        difflib.unified_diff(
            current.splitlines(keepends=True),
            text.splitlines(keepends=True),
            fromfile=str(path),
            tofile=f"{path} (regenerated)",
        )
    )
    print(f"{path} is stale: run `make crds` and commit it", file=sys.stderr)
    return 1
