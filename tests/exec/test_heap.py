"""`keep_freed_memory`: glibc reuses what torch frees instead of faulting fresh pages in.

Each case runs in a process of its own: the setting is process-wide and lasts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from schedc.exec.heap import heap_bytes

pytestmark = pytest.mark.skipif(heap_bytes() is None, reason="needs glibc (mallinfo2)")

MIB = 1 << 20
SIZE_MIB, TIMES = 64, 12

# allocate, touch and free the same 64 MiB tensor again and again, as a step does with its
# logits; count the page faults of the last rounds, and the live heap while one is held. The
# first rounds may still grow the heap even when kept (an aligned request does not fit the
# hole its predecessor left until two holes merge), so they are warm-up.
CHILD = f"""
import json, resource, sys, torch
from schedc.exec.heap import heap_bytes, keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
faults, held = [], []
for _ in range({2 * TIMES}):
    f0, h0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, heap_bytes()
    x = torch.ones({SIZE_MIB} << 18)
    held.append(heap_bytes() - h0)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps(dict(kept=kept, faults=sum(faults[{TIMES}:]), held=held)))
"""


def child(mode: str, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    return json.loads(out.stdout)


def test_kept_memory_is_reused_without_page_faults():
    default, kept = child("default"), child("keep")
    assert kept["kept"] is True
    pages = TIMES * SIZE_MIB * MIB // os.sysconf("SC_PAGE_SIZE")
    # by default every round maps a fresh 64 MiB and faults each page in (fewer with huge
    # pages); kept, the second round on reuses the same memory
    assert default["faults"] > pages // 4, default
    assert kept["faults"] < default["faults"] // 10, (kept, default)
    # the live heap counts the tensor either way: the measurement is unchanged
    for run in (default, kept):
        assert all(SIZE_MIB * MIB <= h < (SIZE_MIB + 1) * MIB for h in run["held"]), run


@pytest.mark.parametrize("var", ["MALLOC_MMAP_MAX_", "GLIBC_TUNABLES"])
def test_a_user_tuned_malloc_is_left_alone(var):
    value = "65536" if var == "MALLOC_MMAP_MAX_" else "glibc.malloc.mmap_max=65536"
    assert child("keep", **{var: value})["kept"] is False
