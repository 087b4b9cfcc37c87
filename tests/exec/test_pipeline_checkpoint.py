"""Checkpoints of a pipeline run (issue #46): `--save` and `--resume` under torchrun
(exec/pipeline_train.py `Saved`). With a DDP bucket a stage a rank saves in the form a DDP
run saves (every parameter whole, by name), so a checkpoint moves between pipeline and
data-parallel layouts; with an fsdp block, each stage's units as a DP FSDP run saves its own.

PP 2 x DP 2 with FSDP per stage, rank 1 killed (SIGKILL) as a save begins, resumes to the
killed run's own losses, bitwise. A chain of layouts, each resuming the checkpoint of the one
before (PP 4 -> PP 2 x DP 2 -> DP 4 -> PP 2 x DP 2), logs the losses of the first within the
suite's fp32 bound, and the PP 2 x DP 2 checkpoint exports to a transformers model with the
loss the run logged. Each world-4 job starts 4 processes: CI's torch tier pays for each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from schedc.exec.checkpoint.store import CRASH_ENV, read_parameters
from tests.goldens import REPO
from tests.oracle import TOL
from tests.ranks import finish, start_ranks

pytestmark = [pytest.mark.torch, pytest.mark.ranks, pytest.mark.xdist_group("pp_checkpoint")]

PP2_DP2 = REPO / "schedules" / "pipeline" / "tiny_pp2_dp2.sched"
PP2_DP2_FSDP = REPO / "schedules" / "pipeline" / "tiny_pp2_dp2_fsdp.sched"
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


@dataclass
class Ran:
    returncode: int  # 0 when every rank exited 0, else the first rank's that did not
    stdout: str  # rank 0's
    stderr: str  # every rank's


def run(*args: str, env: dict | None = None) -> Ran:
    """`schedc run ARGS` on 4 ranks started as torchrun starts them, without its agent (one
    process fewer importing torch on CI's two cores: these tests start eight such jobs)."""
    out = finish(start_ranks([args] * 4, env))
    code = next((c for c, _, _ in out if c), 0)
    return Ran(code, out[0][1], "\n".join(e for _, _, e in out))


def close(got: dict[int, float], want: dict[int, float]) -> None:
    assert got, got
    for s, loss in got.items():
        assert loss == pytest.approx(want[s], rel=TOL["float32"].loss_rtol), (s, got, want)


def test_a_rank_killed_while_saving_resumes_bitwise_with_fsdp_per_stage(tmp_path):
    """PP 2 x DP 2, each stage's units sharded over its 2 replicas, saving every 2 steps:
    rank 1 dies (SIGKILL) as step 4's save begins, and the job ends. Resumed from step 2's
    checkpoint, steps 2 and 3 are the ones the killed run logged, bitwise: each unit is a
    DTensor on its stage's shard group."""
    f, ck = str(PP2_DP2_FSDP), tmp_path / "ck"
    r = run(f, "--steps", "4", "--save", str(ck), "--save-every", "2", "--timeout", "20",
            "--log-json", str(tmp_path / "killed.jsonl"),
            env={CRASH_ENV: "before-write@1#4"})  # fmt: skip
    assert r.returncode != 0
    r = run(f, "--steps", "4", "--resume", str(ck), "--log-json", str(tmp_path / "resumed.jsonl"))
    assert r.returncode == 0, r.stderr
    assert "schedc: resumed from" in r.stdout and "at step 2" in r.stdout
    want, got = losses(tmp_path / "killed.jsonl"), losses(tmp_path / "resumed.jsonl")
    assert sorted(want) == [0, 1, 2, 3]  # the killed run stopped in step 4's save
    assert got == {s: want[s] for s in (2, 3)}  # bitwise: == on floats
    _, model, params = read_parameters(ck)  # every parameter, cut from the stages' units
    assert sorted(params) == sorted(p.name for p in model.params)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """PP 4 for 6 steps (the reference), then each layout resuming the one before it:
    PP 4 @2 -> PP 2 x DP 2, whose @4 -> DP 4, whose @5 -> PP 2 x DP 2. Returns the directory
    and the reference's losses."""
    d = tmp_path_factory.mktemp("chain")
    (d / "pp4.sched").write_text(PP4)
    (d / "dp4.sched").write_text(DP4)
    steps = ("--steps", "6", "--keep", "0")
    r = run(str(d / "pp4.sched"), *steps, "--save", str(d / "pp4"), "--save-every", "2",
            "--log-json", str(d / "pp4.jsonl"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    for src, at, sched, out, every in (
        ("pp4", 2, str(PP2_DP2), "pp2", "2"),  # PP 4 -> PP 2 x DP 2: steps 2-5
        ("pp2", 4, str(d / "dp4.sched"), "dp4", "1"),  # PP 2 x DP 2 -> DP 4: steps 4-5
        ("dp4", 5, str(PP2_DP2), "back", "6"),  # DP 4 -> PP 2 x DP 2: step 5
    ):
        r = run(sched, *steps, "--resume", str(d / src / f"step_{at:08d}"),
                "--save", str(d / out), "--save-every", every,
                "--log-json", str(d / f"{out}.jsonl"))  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert f"at step {at}" in r.stdout
    return d, losses(d / "pp4.jsonl")


def test_pipeline_and_data_parallel_layouts_resume_each_others_checkpoints(chain):
    """PP 4 -> PP 2 x DP 2 -> DP 4 -> PP 2 x DP 2: each resumed layout's steps have the
    reference's losses (the same update), and two layouts' checkpoints of one step hold the
    same parameters (summed in another order: within fp32 rounding)."""
    d, want = chain
    for out, steps in (("pp2", (2, 3, 4, 5)), ("dp4", (4, 5)), ("back", (5,))):
        got = losses(d / f"{out}.jsonl")
        assert sorted(got) == list(steps), (out, got)
        close(got, want)
    t, lr = TOL["float32"], 3e-3  # the suite's fp32 bound on parameters, a step's, x lr
    for a, b in (("pp4", "pp2"), ("pp2", "dp4"), ("dp4", "back")):
        for step in (4, 6):
            x, y = d / a / f"step_{step:08d}", d / b / f"step_{step:08d}"
            if not (x.exists() and y.exists()):
                continue
            (_, _, px), (_, _, py) = read_parameters(x), read_parameters(y)
            assert px.keys() == py.keys()
            diff = torch.cat([(px[n] - py[n]).abs().reshape(-1) for n in px])
            updates = step - 2  # since the layouts parted (AdamW moves each element ~lr)
            assert diff.max() <= t.param_atol * lr * updates, (a, b, step, diff.max())
            share = (diff <= t.param_bulk_atol * lr * updates).float().mean()
            assert share >= t.param_share, (a, b, step, share)


def test_export_of_a_pipeline_checkpoint_gives_the_loss_the_run_logged(chain, tmp_path, capsys):
    """`schedc export` of the PP 2 x DP 2 checkpoint after 4 updates, loaded by
    transformers.GPT2LMHeadModel: its loss on step 4's global batch is the one the run
    logged at step 4 (the same weights, the same sequences)."""
    transformers = pytest.importorskip("transformers")
    from schedc.cli.main import main
    from schedc.compiler import compile_file
    from schedc.model.data import load_batches

    d, _ = chain
    out = tmp_path / "hf"
    assert main(["export", str(d / "pp2" / "step_00000004"), "-o", str(out)]) == 0
    assert capsys.readouterr().out.startswith("schedc: exported step 4 of ")
    m = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    spec = compile_file(str(PP2_DP2)).spec
    x, y = load_batches(spec.data, spec.seq_len, spec.seqs, spec.model.vocab_size).global_batch(4)
    with torch.no_grad():
        logits = m(x).logits
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
    logged = losses(d / "pp2.jsonl")[4]
    assert loss.item() == pytest.approx(logged, rel=TOL["float32"].loss_rtol)


def test_a_one_process_run_resumes_a_pipeline_checkpoint_with_its_parameters(chain, world1):
    """PP 2 x DP 2's checkpoint after 4 updates, resumed by one process (the same model and
    global batch): it holds exactly the saved parameters, each loaded from the pipeline rank
    that wrote it."""
    from schedc.exec.checkpoint import store
    from tests.world1 import executor

    d, _ = chain
    ck = d / "pp2" / "step_00000004"
    ex = executor(HEAD.replace("world 4", "world 1") + "micro 2\n", steps=6)
    try:
        assert store.load(ex, ck) == 4
        _, _, saved = read_parameters(ck)
        held = ex.strategy.full_tensors(grad=False)
        assert held.keys() == saved.keys()
        for name, t in saved.items():
            assert torch.equal(held[name], t), name
    finally:
        ex.close()
