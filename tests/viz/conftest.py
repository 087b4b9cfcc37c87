"""The pictures' shared fixture: a real trace, written once per session by `schedc run`."""

from __future__ import annotations

import pytest

from tests.ranks import python

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
    one = {"OMP_NUM_THREADS": "1"}
    r = python("-m", "schedc", "run", "w1.sched", "--trace", "t.json", env=one, cwd=d)
    assert r.returncode == 0, r.stderr
    return d
