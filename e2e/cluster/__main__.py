"""``python -m e2e.cluster up|down STATE_DIR``: the local control plane for humans."""

from __future__ import annotations

import sys
from pathlib import Path

from e2e.cluster.runner import LocalCluster, stop_from_pidfiles


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in {"up", "down"}:
        print("usage: python -m e2e.cluster up|down STATE_DIR", file=sys.stderr)
        return 2
    state = Path(argv[1]).resolve()
    if argv[0] == "down":
        stop_from_pidfiles(state)
        return 0
    cluster = LocalCluster(state).start()
    cluster.procs.clear()  # detach: `down` stops them by the pid files
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
