"""`schedc run` of a bundled pipeline schedule under torchrun (#31): each rank runs its
stages' proven program, and the steps it logs are one process's.

schedules/pipeline/tiny_pp2_interleaved.sched (interleaved 1F1B, 4 stages on 2 ranks)
against a world-1 schedule that `schedc check` says makes the same update (the same model,
seed, sequences and optimizer, k = 4 micro-steps of 2): the losses and gradient norms of
three steps agree within the suite's fp32 bound (tests/oracle.py), and the run's lines say
what ran. The executor's own equivalence suite (every schedule, pp 1-4, on the rank pool)
is tests/exec/test_pipeline_exec.py.
"""

from __future__ import annotations

import json

import pytest

from schedc.cli.main import main
from tests.goldens import REPO
from tests.oracle import TOL
from tests.ranks import python, torchrun

pytestmark = [pytest.mark.torch, pytest.mark.ranks]

PIPE = REPO / "schedules" / "pipeline" / "tiny_pp2_interleaved.sched"
ONE = """\
model tiny
world 1
batch 8 x 64
micro 2
steps 40
seed 1337
data corpus
optimizer adamw { lr = 3e-3  min_lr = 3e-4  warmup = 5 }
"""


def records(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_pipeline_run_logs_what_one_process_computes(tmp_path, capsys):
    one = tmp_path / "one.sched"
    one.write_text(ONE)
    assert main(["check", str(one), str(PIPE)]) == 0  # the same update, proven first
    assert "the same update" in capsys.readouterr().out
    r = torchrun(2, str(PIPE), "--steps", "3", "--log-json", str(tmp_path / "pp.jsonl"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(
        f"schedc: {PIPE}: pipeline (interleaved-1f1b, 4 stages, loop), world 2, 4 micro-steps of 2 x 64"
    ), r.stdout
    w1 = python(
        "-m",
        "schedc",
        "run",
        str(one),
        "--steps",
        "3",
        "--log-json",
        str(tmp_path / "w1.jsonl"),
        env={"OMP_NUM_THREADS": "1"},
    )
    assert w1.returncode == 0, w1.stderr
    got, want = records(tmp_path / "pp.jsonl"), records(tmp_path / "w1.jsonl")
    assert [g["step"] for g in got] == [0, 1, 2]
    for g, w in zip(got, want, strict=True):
        assert g["lr"] == w["lr"]
        assert g["loss"] == pytest.approx(w["loss"], rel=TOL["float32"].loss_rtol)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=TOL["float32"].norm_rtol)
