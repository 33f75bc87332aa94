"""The router's allocator settings: freed large buffers stay with the process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from encoderpool_router import heap

ROOT = Path(__file__).resolve().parents[2]

# In a fresh interpreter: how many page faults 20 rounds of a 2 MB request's buffers cost.
_FAULTS = """
import resource, sys
from encoderpool_router.heap import keep_freed_memory
print(keep_freed_memory())
chunk = b"x" * (256 << 10)
def one():
    parts = [bytes(bytearray(chunk)) for _ in range(8)]  # as socket reads
    body = b"".join(parts)
    return body.decode() + "y", body + b"}"
one()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    one()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS],
        # The router image's packages: the router and the contracts it imports.
        env={**env, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("contracts", "router"))},
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return out[0], int(out[1])


@pytest.mark.skipif(not hasattr(os, "confstr"), reason="glibc only")
def test_freed_buffers_are_reused_without_faulting_pages_in() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if os.confstr("CS_GNU_LIBC_VERSION") is None:
        pytest.skip("not glibc")
    applied, faults = _faults(env)
    assert applied == "True"
    assert faults < 100  # the buffers of 20 requests of 2 MB: ~500 pages each, reused
    # The thresholds an operator set in the environment are theirs: left alone.
    applied, _ = _faults({**env, "MALLOC_TRIM_THRESHOLD_": str(1 << 20)})
    assert applied == "False"


def test_the_thresholds_are_what_glibc_accepts() -> None:
    assert heap.MMAP_THRESHOLD <= 32 << 20  # glibc refuses more on 64-bit
    assert heap.TRIM_THRESHOLD >= 2 * heap.MMAP_THRESHOLD
