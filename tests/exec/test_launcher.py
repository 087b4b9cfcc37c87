"""`schedc run FILE` starts the file's ranks itself (exec/launcher.py, torch's elastic agent as
`torchrun --standalone` runs it): one command, the world said once, in the file; a user error
said once; a rank whose launcher is killed leaves, saying why; a rank stopped at start-up,
before it ever beats, is named within seconds (exec/heartbeat.py `LocalPeer`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.goldens import REPO
from tests.ranks import python, start_python, wait_for_step, workers

SCHED = str(REPO / "schedules" / "tiny_ddp_overlap.sched")  # world 2
BOUND_S = 30  # a stopped or orphaned rank is dealt with well within this

pytestmark = [
    pytest.mark.ranks,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


def test_schedc_run_starts_the_ranks_its_file_names():
    r = python("-m", "schedc", "run", SCHED, "--steps", "2", timeout=180)
    assert r.returncode == 0, r.stderr
    assert "ddp, world 2," in r.stdout
    assert r.stdout.count("step    1/2 |") == 1  # rank 0 logs, once
    assert "schedc: done: 2 steps" in r.stdout
    # schedc's own lines only: the elastic agent's log lines are not the user's concern
    assert all(x.startswith("schedc: ") for x in r.stderr.splitlines() if x), r.stderr


def test_a_rank_s_user_error_is_said_once_without_a_traceback(tmp_path):
    """A refusal only a rank can make (its checkpoint is read after the ranks agree): one
    line, exit 1, not a launcher's traceback once a rank."""
    empty = tmp_path / "ckpt"
    empty.mkdir()
    r = python("-m", "schedc", "run", SCHED, "--resume", str(empty), timeout=180)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and str(empty) in lines[0], r.stderr
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr


def gone(pid: int) -> bool:
    """Exited (or a zombie nobody has reaped yet: it runs no more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.faults
def test_ranks_leave_when_their_launcher_is_killed():
    p = start_python("-m", "schedc", "run", SCHED, "--steps", "100000", ranks=2)
    wait_for_step(p, 1)
    ranks = workers(p)
    assert sorted(ranks) == [0, 1], ranks
    os.kill(p.pid, signal.SIGKILL)  # the launcher can end no one now
    p.wait()
    t0 = time.monotonic()
    while not all(gone(pid) for pid in ranks.values()) and time.monotonic() - t0 < BOUND_S:
        time.sleep(0.1)
    left = time.monotonic() - t0
    for pid in ranks.values():  # a regression must fail, not leave them training
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left < 5, left
    err = p.stderr.read() if p.stderr else ""  # the ranks wrote into the launcher's pipe
    # each says why: the one that saw it first, and the one whose collective that broke
    # (after gloo's own warning of the reset connection, which no Python code can stop)
    for r in (0, 1):
        assert f"schedc: rank {r}: its launcher (pid {p.pid}) is gone" in err, err
    assert "error on rank" not in err, err


@pytest.mark.faults
def test_a_rank_stopped_at_start_up_is_named_within_seconds():
    """Before its first beat, and before the job's rendezvous: its watcher sees its process
    stopped; the job ends within the bound, not at --timeout (300 s)."""
    p = start_python("-m", "schedc", "run", SCHED, "--steps", "100000", ranks=2)
    t0 = time.monotonic()
    pid = None
    while pid is None and time.monotonic() - t0 < 60:
        pid = workers(p).get(1)  # as soon as the launcher has started it
        time.sleep(0.01)
    assert pid is not None, "rank 1 never started"
    os.kill(pid, signal.SIGSTOP)
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("the job still ran 120 s after rank 1 was stopped") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    elapsed = time.monotonic() - t0
    assert p.returncode != 0
    assert elapsed < BOUND_S, (elapsed, err)
    assert f"rank 1's process (pid {pid}, this node) has been stopped for" in err, err
    assert "rank 1 was stopped (SIGSTOP); sent SIGCONT" in err, err


def test_auto_trains_on_the_cpu_where_the_gpus_are_fewer_than_the_ranks(monkeypatch):
    """`make demo` (world 2) on a one-GPU machine: NCCL cannot put two ranks on one device,
    so `--device auto` picks the CPU and says why; one GPU a rank, it picks the rank's."""
    import torch

    from schedc.exec.options import auto_note, pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    device = pick_device("auto")
    assert device.type == "cpu"
    assert auto_note("auto", device) == (
        "--device auto: cpu, as this node runs 2 ranks and has 1 GPU "
        "(--device cuda needs one a rank)"
    )
    assert auto_note("cpu", device) == ""  # asked for: nothing to explain
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert pick_device("auto") == torch.device("cuda", 0)
