"""Under real torchrun, every rank's failure is named, and the job ends within 30 s.

torchrun SIGTERMs the surviving ranks ~0.1 s after one dies, before their own failure
report; `schedc run` answers that SIGTERM with one line naming the plan instruction the
rank was at (schedc/exec/failures.py: `terminated`). A stopped rank cannot take the SIGTERM, so
torchrun would wait 30 s more before SIGKILL; the rank that names it silent sends it
SIGCONT (`wake_stopped`). tests/exec/test_robust.py covers ranks launched by hand.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.goldens import REPO
from tests.ranks import start_torchrun, wait_for_step, workers

SCHED = str(REPO / "schedules" / "tiny_ddp_overlap.sched")
BOUND_S = 30  # the bound: the job ends within 30 s of the kill or stop

pytestmark = [
    pytest.mark.ranks,
    pytest.mark.faults,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

# the SIGTERM line: `... at step 4, instruction 55 (wait on stream compute for e2 =
# allreduce[b2]@mb3)`, `(... (bwd[h.3]@mb1 on stream compute)`, `(record e0 on stream ...)`
OP = r"[\w.]+(\[[\w.]+\])?(@mb\d+)?(:\w+)?"
INSTRUCTION = re.compile(
    rf"^schedc: rank (\d) terminated by SIGTERM at step \d+, instruction \d+ "
    rf"\(({OP} on stream \w+|wait on stream \w+ for e\d+ = {OP}"
    rf"|record e\d+ on stream \w+ after {OP})\)[;,]"
)


def torchrun(timeout: int | None) -> subprocess.Popen:
    """`schedc run` of a long run on two ranks; `timeout` None: the default --timeout."""
    more = ["--timeout", str(timeout)] if timeout is not None else []
    return start_torchrun(2, SCHED, "--steps", "100000", *more)


def running(p: subprocess.Popen) -> dict[int, int]:
    """Wait until rank 0 logs step 1; return {local rank: pid} of torchrun's workers."""
    wait_for_step(p, 1)
    ranks = workers(p)
    assert sorted(ranks) == [0, 1], ranks
    return ranks


def ended(p: subprocess.Popen, t0: float) -> tuple[float, str]:
    """Wait for torchrun (generously: a regression must fail, not hang the suite)."""
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        raise AssertionError(f"torchrun still running 120 s later:\n{err}") from None
    return time.monotonic() - t0, err


def schedc_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("schedc:")]


def test_a_killed_rank_leaves_the_survivor_naming_its_instruction():
    p = torchrun(timeout=60)
    pids = running(p)
    # stop rank 1 first, so that rank 0 is surely blocked in a collective waiting for it,
    # then kill it: gloo fails rank 0's wait at once and torchrun SIGTERMs rank 0
    os.kill(pids[1], signal.SIGSTOP)
    time.sleep(2)
    os.kill(pids[1], signal.SIGKILL)
    elapsed, err = ended(p, time.monotonic())
    assert p.returncode != 0
    assert elapsed < BOUND_S, (elapsed, err)
    lines = schedc_lines(err)
    assert lines, err
    m = INSTRUCTION.match(lines[-1])
    assert m and m.group(1) == "0", err  # the survivor's last line names its instruction
    assert "nothing from rank 1" in lines[-1], lines[-1]  # and whom it did not hear from
    assert "exitcode  : -9" in err  # torchrun's report: rank 1 was SIGKILLed
    assert f'File "{REPO / "schedc"}' not in err  # no traceback from schedc itself


def test_a_stopped_rank_is_named_and_the_job_ends_within_the_bound():
    """At the default --timeout (300 s): a stopped rank beats no more, so its watcher names
    it within seconds (exec/heartbeat.py), whatever the collectives wait."""
    p = torchrun(timeout=None)
    pids = running(p)
    os.kill(pids[1], signal.SIGSTOP)  # alive, but answers nothing
    try:
        elapsed, err = ended(p, time.monotonic())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGKILL)
    assert p.returncode != 0
    assert elapsed < BOUND_S, (elapsed, err)  # not the 300 s timeout, nor torchrun's 30 s
    lines = schedc_lines(err)
    assert any("rank 1 stopped answering" in x for x in lines), err
    assert any("rank 1 was stopped (SIGSTOP); sent SIGCONT" in x for x in lines), err
    # continued, rank 1 names where it was: at torchrun's SIGTERM, or failing on its own
    assert any(
        INSTRUCTION.match(x)
        and x.startswith("schedc: rank 1 ")
        or x.startswith("schedc: error on rank 1")
        for x in lines
    ), err
    assert f'File "{REPO / "schedc"}' not in err
