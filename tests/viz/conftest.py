"""The pictures' shared fixture: a real trace, written once per session by `schedc run`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.goldens import REPO

WORLD1_DDP = """\
model nano
world 1
batch 4 x 32
micro 2
steps 2
data corpus
ddp {
  bucket b1 = head, h.1
  bucket b2 = h.0, embed
  overlap on
  no_sync on
}
"""


@pytest.fixture(scope="session")
def real_trace(tmp_path_factory):
    """A directory with w1.sched and t.json: two steps of a world-1 DDP schedule (real
    collectives, no torchrun) that `schedc run --trace` wrote. Tests that use it need torch
    (tests/conftest.py marks them)."""
    d = tmp_path_factory.mktemp("run")
    (d / "w1.sched").write_text(WORLD1_DDP)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    subprocess.run(
        [sys.executable, "-m", "schedc", "run", "w1.sched", "--trace", "t.json"],
        cwd=d,
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return d
