"""What `schedc run` prints (issue 19): step i/N and an ETA on every line, a closing
summary, typed --log-json records, the user's OMP_NUM_THREADS kept, and under torchrun
schedc's own error in torchrun's report.

One real 3-step world-1 run (a process of its own) is shared by the first tests; its
summary is checked against its own --log-json records, so no figure is assumed.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from tests.goldens import REPO
from tests.ranks import python, torchrun

pytestmark = pytest.mark.torch

ONE = REPO / "schedules" / "tiny_1gpu.sched"
STEPS = 3
THREADS = 1  # schedc's own choice at world 1 is every core
LINE = re.compile(
    r"^step +(\d+)/(\d+) \| loss (\S+) \| lr \S+ \| norm \S+ \| dt (\S+)ms \| "
    r"tok/sec (\S+) \| eta (\S+)$"
)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """tiny_1gpu for 3 steps with OMP_NUM_THREADS=1: at world 1 schedc by itself takes
    every core (torch caps OMP_NUM_THREADS at the cores, so a larger value would not show)."""
    log = tmp_path_factory.mktemp("run") / "log.jsonl"
    run = ["run", str(ONE), "--steps", str(STEPS), "--log-json", str(log)]
    r = python("-m", "schedc", *run, env={"OMP_NUM_THREADS": str(THREADS)})
    assert r.returncode == 0, r.stderr
    records = [json.loads(x) for x in log.read_text().splitlines()]
    return r.stdout, records


def test_a_small_vocabulary_says_it_folds_the_ids(ran):
    """#29 stumble 8: GPT-2 ids beyond the tiny model's 4,096 were folded without a word."""
    out, _ = ran
    want = (
        "schedc: data: token ids >= 4,096 are folded to id % 4,096 (the model's vocabulary "
        "is smaller than GPT-2's 50,257)"
    )
    assert out.splitlines()[1] == want, out


def test_every_step_line_has_step_i_of_n_and_an_eta(ran):
    out, _ = ran
    steps = [LINE.match(x) for x in out.splitlines() if x.startswith("step ")]
    assert len(steps) == STEPS and all(steps), out
    assert [int(m[1]) for m in steps] == list(range(STEPS))
    assert {int(m[2]) for m in steps} == {STEPS}
    etas = [m[6] for m in steps]
    # unknown after the warm-up step alone (its time says little of a later step's: the ETA
    # of a 14 s run said 1m01s at step 0), then steps since the warm-up times those left
    assert etas[0] == "-", etas
    assert all(re.fullmatch(r"\d+\.\ds|\d+s|\d+m\d\ds|\d+h\d\dm", e) for e in etas[1:]), etas
    assert etas[-1] == "0.0s"  # nothing left after the last step


def test_the_run_ends_with_a_summary_that_matches_its_steps(ran):
    out, records = ran
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(
        rf"schedc: done: {STEPS} steps \(0-{STEPS - 1} of {STEPS}\) in (\S+); ([\d,]+) tokens/s "
        r"mean over steps 1-2 \(step 0, the warm-up, took (\S+)s and is left out\); "
        r"final loss (\S+); peak RSS (\S+) MiB \(rank 0's process\)",
        last,
    )
    assert m, last
    later = records[1:]  # the mean leaves step 0 out: tokens over time of steps 1-2
    want = sum(r["tokens_per_s"] * r["dt_ms"] for r in later) / sum(r["dt_ms"] for r in later)
    assert int(m[2].replace(",", "")) == round(want)
    assert float(m[3]) == pytest.approx(records[0]["dt_ms"] / 1e3, abs=0.006)
    assert m[4] == f"{records[-1]['loss']:.6f}"
    assert 10 < float(m[5]) < 100_000


def test_log_json_records_have_types(ran):
    _, records = ran
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert set(r) == {
            "step",
            "loss",
            "lr",
            "grad_norm",
            "dt_ms",
            "tokens_per_s",
            "skipped",
            "skip_reason",
        }
        assert type(r["step"]) is int
        for k in ("loss", "lr", "grad_norm", "dt_ms", "tokens_per_s"):
            assert type(r[k]) is float and math.isfinite(r[k]) and r[k] >= 0, (k, r)
        assert r["skipped"] is False and r["skip_reason"] is None


def test_a_skipped_step_is_a_boolean_and_its_nan_is_null():
    """--nonfinite skip: JSON has no NaN (json.dumps would write it, and readers refuse it)."""
    from schedc.exec.options import StepStats
    from schedc.exec.report import log_record

    st = StepStats(3, float("nan"), 1e-3, float("inf"), 5.0, 100.0, skipped="step 3: nan")
    rec = json.loads(json.dumps(log_record(st), allow_nan=False))
    assert rec["skipped"] is True and rec["skip_reason"] == "step 3: nan"
    assert rec["loss"] is None and rec["grad_norm"] is None and rec["lr"] == 1e-3


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: 1 thread is the default too")
def test_omp_num_threads_is_respected_and_reported(ran):
    """It was overridden: 'OMP_NUM_THREADS=1 schedc run' printed 2 threads on 2 cores."""
    out, _ = ran
    assert f"({THREADS} thread per rank, OMP_NUM_THREADS={THREADS})" in out.splitlines()[0], out


def test_unset_threads_are_one_per_rank_when_a_node_runs_several(monkeypatch):
    import torch

    from schedc.exec.train import cpu_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert cpu_threads(2) == "" and torch.get_num_threads() == 1
        hint = cpu_threads(1)  # all cores, and a hint if the machine is busy now
        assert hint == "" or hint.startswith("; the machine is busy, load ")
        assert torch.get_num_threads() == (os.cpu_count() or 1)
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "5")  # set: left alone
        assert cpu_threads(2) == ", OMP_NUM_THREADS=5" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_busy_machine_hints_one_thread_at_world_1():
    """#29 stumble 7: every core for one rank ran 15x slower than one thread on a shared
    2-core machine, without a word."""
    from schedc.exec.train import busy_hint

    assert busy_hint(2, 1.9, 2) == (
        "; the machine is busy, load 1.9 on 2 cores: OMP_NUM_THREADS=1 may run faster"
    )
    assert busy_hint(2, 0.4, 2) == ""  # idle: every core is right
    assert busy_hint(1, 8.0, 2) == ""  # one thread already
    assert busy_hint(16, 7.0, 16) == ""  # under half the cores


def test_eta_leaves_out_the_warm_up_step(monkeypatch):
    from schedc.exec import report

    now = [100.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    clock = report.RunClock(0, 6)

    class St:
        def __init__(self, step):
            self.step, self.dt_ms, self.tokens_per_s, self.loss, self.skipped = (
                step,
                1000.0,
                10.0,
                1.0,
                "",
            )

    now[0] += 5.0  # the warm-up step: 5 s
    assert clock.done(St(0)) == float("inf")  # not known: the warm-up is no later step
    now[0] += 1.0
    assert clock.done(St(1)) == pytest.approx(4.0)  # 1 s per step since, 4 left
    now[0] += 2.0
    assert clock.done(St(2)) == pytest.approx(4.5)  # 1.5 s per step, 3 left


def test_log_line():
    from schedc.exec.report import format_log

    line = format_log(3, 7.123456, 1.2e-4, 1.2345, 12.34, 12345.67)
    assert line == (
        "step    3 | loss 7.123456 | lr 1.2000e-04 | norm 1.2345 | dt 12.34ms | tok/sec 12345.67"
    )
    assert format_log(3, 7.0, 1e-4, 1.0, 1.0, 1.0, mfu=0.42).endswith(" | mfu 42.00%")


def test_fmt_eta():
    from schedc.exec.report import fmt_eta

    assert fmt_eta(float("inf")) == "-"
    assert [fmt_eta(s) for s in (0, 0.44, 9.96, 12.4, 72, 3599, 7380)] == [
        "0.0s",
        "0.4s",
        "10.0s",
        "12s",
        "1m12s",
        "59m59s",
        "2h03m",
    ]


@pytest.mark.ranks
def test_under_torchrun_the_report_shows_schedcs_error_not_a_link():
    """A world-2 schedule started with one rank: torchrun's Root Cause names schedc's error
    (record wrote it to TORCHELASTIC_ERROR_FILE), where it said 'To enable traceback see'."""
    r = torchrun(1, "schedules/tiny_ddp_overlap.sched", "--steps", "1")
    assert r.returncode == 1
    line = (
        "schedc: error on rank 0: schedules/tiny_ddp_overlap.sched is a world-2 schedule, "
        "but this job has 1 rank"
    )
    assert r.stderr.startswith(line), r.stderr  # the rank's own line comes first
    assert f"traceback : {line}" in r.stderr, r.stderr
    assert "To enable traceback" not in r.stderr


def test_a_missing_relative_data_file_names_the_working_directory(tmp_path):
    """`data "notes/x.txt"` is read from the working directory, not the schedule's: the
    error says where it looked (it said 'DataError: notes/x.txt: no such file')."""
    sched = tmp_path / "sub" / "d.sched"
    sched.parent.mkdir()
    (sched.parent / "notes").mkdir()
    (sched.parent / "notes" / "x.txt").write_text("beside the schedule, not in the cwd\n")
    sched.write_text(ONE.read_text().replace("data corpus", 'data "notes/x.txt"'))
    assert 'data "notes/x.txt"' in sched.read_text()
    r = python("-m", "schedc", "run", str(sched), "--steps", "1", cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.strip() == (
        "schedc: error on rank 0: notes/x.txt: no such file (a relative `data` path is read "
        f"from the working directory, {tmp_path}, not from the schedule's directory: run from "
        "there, or write an absolute path)"
    ), r.stderr
