"""A static error under torchrun (#29 stumble 8): said before torch is imported, once a node
rather than once a rank, and written where torchrun's report reads it.

torchrun is played by its environment: TORCHELASTIC_ERROR_FILE (the rank's error file) and
TORCHELASTIC_RUN_ID (the job). No torch is needed: the point is that none is imported.
"""

from __future__ import annotations

import json
import uuid

from tests.ranks import python

BAD = "model tiny\nworld 2\nbatch 16 x 64\nmicro 2\nsteps 2\ndata corpus\n"
BAD += "optimizer adamw { lr = 1e-3 }\nddp { bucket_cap 25 }\n"

PROBE = """
import sys
from schedc.cli.main import main
code = main(["run", sys.argv[1]])
print("torch imported" if "torch" in sys.modules else "no torch", code)
"""


def rank(tmp_path, job: str, r: int, sched):
    env = {
        "TORCHELASTIC_ERROR_FILE": str(tmp_path / f"error{r}.json"),
        "TORCHELASTIC_RUN_ID": job,
        "RANK": str(r),
    }
    return python("-c", PROBE, str(sched), env=env, timeout=60)


def test_a_static_error_is_said_once_a_node_before_torch_is_imported(tmp_path):
    sched = tmp_path / "bad.sched"
    sched.write_text(BAD)
    job = uuid.uuid4().hex
    first, second = rank(tmp_path, job, 0, sched), rank(tmp_path, job, 1, sched)
    assert first.stdout.split() == ["no", "torch", "1"], first.stderr
    assert second.stdout.split() == ["no", "torch", "1"], second.stderr
    diagnostic = f"{sched}:8:18: error: bucket_cap needs a unit: 25 what?  [value-range]"
    assert diagnostic in first.stderr and "1 error" in first.stderr
    assert second.stderr == ""  # the same words, already said on this node
    for r in (0, 1):  # torchrun's report has it from every rank
        told = json.loads((tmp_path / f"error{r}.json").read_text())["message"]
        assert told["message"] == diagnostic
        assert "hint: did you mean `25 MiB`?" in told["extraInfo"]["py_callstack"]
    # another job says it again
    again = rank(tmp_path, uuid.uuid4().hex, 1, sched)
    assert diagnostic in again.stderr


def test_outside_torchrun_every_error_is_said(tmp_path):
    sched = tmp_path / "bad.sched"
    sched.write_text(BAD)
    for _ in range(2):
        p = python("-m", "schedc", "run", str(sched), timeout=60)
        assert p.returncode == 1 and "needs a unit" in p.stderr
