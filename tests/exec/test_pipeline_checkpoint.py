"""Checkpoints of a pipeline run (issue #46): `--save` and `--resume` of PP 2 x DP 2 (a DDP
bucket a stage) under torchrun, in the form a DDP run saves (every parameter whole, by
name: exec/pipeline_train.py `Saved`), so a checkpoint moves between pipeline and
data-parallel layouts.

One straight PP 2 x DP 2 run of 6 steps, saving every 2, is the reference. A run whose rank 1
is killed (SIGKILL) in the middle of its first save resumes to the straight run's losses,
bitwise. The straight run's step-2 checkpoint resumes as DP 4 (PP -> DP), DP 4's step-4 one
as PP 2 x DP 2 (DP -> PP), and a PP 4 run's step-2 one as PP 2 x DP 2 (PP 4 -> PP 2 x DP 2):
each with the saved parameters, and the next steps' losses the straight run's within the
suite's fp32 bound (here they are bitwise too: the same sums in the same order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from schedc.exec.checkpoint.store import CRASH_ENV, read_parameters
from tests.goldens import REPO
from tests.oracle import TOL
from tests.ranks import torchrun

pytestmark = [pytest.mark.torch, pytest.mark.ranks, pytest.mark.xdist_group("pp_checkpoint")]

PP2_DP2 = REPO / "schedules" / "pipeline" / "tiny_pp2_dp2.sched"
HEAD = """model tiny
world 4
batch 8 x 64
steps 40
seed 1337
data corpus
optimizer adamw { lr = 3e-3  min_lr = 3e-4  warmup = 5 }
"""
DP4 = HEAD + "micro 2\nddp {\n  bucket_cap 25 MiB\n}\n"  # 1 micro-step of 2 a rank
PP4 = (
    HEAD
    + """pipeline {
  stage s0 = embed, h.0
  stage s1 = h.1
  stage s2 = h.2
  stage s3 = h.3, head
  degree 4
  schedule 1f1b
  microbatches 4
}
"""
)


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def run(*args: str, env: dict | None = None):
    return torchrun(4, *args, env=env)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    d = tmp_path_factory.mktemp("straight")
    r = run(str(PP2_DP2), "--steps", "6", "--save", str(d / "ck"), "--save-every", "2",
            "--keep", "0", "--log-json", str(d / "log.jsonl"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    return d / "ck", losses(d / "log.jsonl")


def close(got: dict[int, float], want: dict[int, float]) -> None:
    assert got, got
    for s, loss in got.items():
        assert loss == pytest.approx(want[s], rel=TOL["float32"].loss_rtol), (s, got, want)


def same_parameters(a: Path, b: Path) -> None:
    _, _, pa = read_parameters(a)
    _, _, pb = read_parameters(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_a_rank_killed_while_saving_resumes_bitwise(straight, tmp_path):
    ck, want = straight
    log = tmp_path / "resumed.jsonl"
    # rank 1 dies once its shard of step 2's checkpoint is written; rank 0 completes and
    # publishes it, then the survivors find rank 1 gone
    r = run(str(PP2_DP2), "--steps", "6", "--save", str(tmp_path / "ck"), "--save-every", "2",
            "--timeout", "20", env={CRASH_ENV: "after-write@1"})  # fmt: skip
    assert r.returncode != 0
    r = run(str(PP2_DP2), "--steps", "6", "--resume", str(tmp_path / "ck"),
            "--save", str(tmp_path / "ck"), "--save-every", "6", "--log-json", str(log))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "schedc: resumed from" in r.stdout and "at step 2" in r.stdout
    got = losses(log)
    assert got == {s: want[s] for s in (2, 3, 4, 5)}  # bitwise: == on floats
    same_parameters(ck / "step_00000006", tmp_path / "ck" / "step_00000006")


def test_pipeline_and_data_parallel_resume_each_others_checkpoints(straight, tmp_path):
    ck, want = straight
    dp4 = tmp_path / "dp4.sched"
    dp4.write_text(DP4)
    # PP 2 x DP 2 -> DP 4: from step 2 to 6, saving at 4 and 6
    r = run(str(dp4), "--steps", "6", "--resume", str(ck / "step_00000002"),
            "--save", str(tmp_path / "dp"), "--save-every", "2", "--keep", "0",
            "--log-json", str(tmp_path / "dp.jsonl"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    close(losses(tmp_path / "dp.jsonl"), want)
    # DP 4 -> PP 2 x DP 2: from DP's step 4 to 6, its parameters the straight run's at 6
    r = run(str(PP2_DP2), "--steps", "6", "--resume", str(tmp_path / "dp" / "step_00000004"),
            "--log-json", str(tmp_path / "pp.jsonl"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "at step 4" in r.stdout
    close(losses(tmp_path / "pp.jsonl"), want)
    _, _, saved = read_parameters(tmp_path / "dp" / "step_00000004")
    _, _, resumed_from = read_parameters(ck / "step_00000004")
    for name, t in saved.items():  # what DP saved at 4 is what PP would have
        assert torch.allclose(t, resumed_from[name], rtol=1e-5, atol=1e-6), name


def test_a_pp4_checkpoint_resumes_as_pp2_x_dp2(straight, tmp_path):
    _, want = straight
    pp4 = tmp_path / "pp4.sched"
    pp4.write_text(PP4)
    r = run(str(pp4), "--steps", "2", "--save", str(tmp_path / "ck"), "--save-every", "2",
            "--log-json", str(tmp_path / "pp4.jsonl"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    close(losses(tmp_path / "pp4.jsonl"), want)
    r = run(str(PP2_DP2), "--steps", "4", "--resume", str(tmp_path / "ck"),
            "--log-json", str(tmp_path / "pp2.jsonl"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    close(losses(tmp_path / "pp2.jsonl"), want)
