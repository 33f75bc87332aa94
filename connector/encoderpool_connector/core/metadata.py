"""What a worker tells its scheduler each step, common to both transports.

vLLM merges the worker metadata of all ranks with ``aggregate``. Sets of
mm_hashes are united and counters summed; a transport's subclass only adds
fields (of those two kinds), so there is one merge for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from typing_extensions import Self
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata


@dataclass
class WorkerReport(ECConnectorWorkerMetadata):  # type: ignore[misc]  # vLLM is untyped here
    """Worker -> scheduler: loads that failed after verification, and counters.

    Filled by each worker rank. The counters ride here because vLLM's V1
    model runner (the one CPUs use) drops the worker's
    ``get_ec_connector_stats``; the scheduler folds them into its own stats.
    """

    failed: set[str] = field(default_factory=set)
    stats: dict[str, Any] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> Self:
        """Both ranks' report in one: sets united, counters (the ``stats`` dict) summed."""
        assert isinstance(other, type(self)), type(other)
        merged: dict[str, Any] = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, set):
                merged[f.name] = mine | theirs
            else:
                assert isinstance(mine, dict), f.name
                summed = dict(mine)
                for k, v in theirs.items():
                    summed[k] = summed.get(k, 0) + v
                merged[f.name] = summed
        return type(self)(**merged)
