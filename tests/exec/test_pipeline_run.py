"""`schedc run` of a bundled pipeline schedule under torchrun (#31): each rank runs its
stages' proven program, and the steps it logs are one process's.

schedules/pipeline/tiny_pp2_interleaved.sched (interleaved 1F1B, 4 stages on 2 ranks),
tiny_pp2_zbv.sched (ZB-V, 4 stages on 2 ranks in a V: the loss stage on rank 0, beside the
embed) and tiny_pp2_dp2_fsdp.sched (DP x PP: 1F1B on 2 stages x 2 replicas, world 4, each stage's
parameters sharded over its replicas), each against a world-1 schedule that `schedc check` says makes the same update (the same model,
seed, sequences and optimizer, k = 4 micro-steps of 2): the losses and gradient norms of
three steps agree within the suite's fp32 bound (tests/oracle.py), and the run's lines say
what ran. The executor's own equivalence suite (every schedule, pp 1-4, on the rank pool)
is tests/exec/test_pipeline_exec.py, which also runs every bundled pipeline file (tiny_pp2_dp2.sched
among them, one bucket a stage) on the pool in fp32 and bf16.
"""

from __future__ import annotations

import json
import re

import pytest

from schedc.cli.main import main
from schedc.ir.op import Kind
from tests.goldens import REPO
from tests.oracle import TOL
from tests.pipeline_ranks import ONE_PROCESS
from tests.ranks import python, torchrun

pytestmark = [pytest.mark.torch, pytest.mark.ranks]

PIPELINE = REPO / "schedules" / "pipeline"


def records(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple:
    """The world-1 schedule's path and its three steps' records (run once for both tests)."""
    tmp = tmp_path_factory.mktemp("one")
    one = tmp / "one.sched"
    one.write_text(ONE_PROCESS)
    w1 = python(
        "-m",
        "schedc",
        "run",
        str(one),
        "--steps",
        "3",
        "--log-json",
        str(tmp / "w1.jsonl"),
        env={"OMP_NUM_THREADS": "1"},
    )
    assert w1.returncode == 0, w1.stderr
    return one, records(tmp / "w1.jsonl")


@pytest.mark.parametrize(
    "name, world, said",
    [
        # one world-2 and one world-4 file under torchrun: the launch, log and update path
        # is the same for every schedule (ZB-V, HSDP per stage: their numerics on the pool,
        # tests/exec/test_pipeline_exec.py; their runs by hand, docs/pipeline.md)
        ("tiny_pp2_interleaved.sched", 2, "(interleaved-1f1b, 4 stages, loop), world 2, 4 "),
        ("tiny_pp2_dp2_fsdp.sched", 4, "(1f1b, 2 stages, loop), world 4, 2 "),
    ],
)
def test_a_pipeline_run_logs_what_one_process_computes(
    tmp_path, capsys, one_process, name, world, said
):
    one, want = one_process
    pipe = PIPELINE / name
    assert main(["check", str(one), str(pipe)]) == 0  # the same update, proven first
    assert "the same update" in capsys.readouterr().out
    r = torchrun(world, str(pipe), "--steps", "3", "--log-json", str(tmp_path / "pp.jsonl"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"schedc: {pipe}: pipeline {said}micro-steps of 2 x 64"), r.stdout
    got = records(tmp_path / "pp.jsonl")
    assert [g["step"] for g in got] == [0, 1, 2]
    for g, w in zip(got, want, strict=True):
        assert g["lr"] == w["lr"]
        assert g["loss"] == pytest.approx(w["loss"], rel=TOL["float32"].loss_rtol)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=TOL["float32"].norm_rtol)
    # every rank's predicted peak beside its measured one, as a DP run says its own
    line = next(x for x in r.stderr.splitlines() if x.startswith("schedc: memory "))
    for rank in range(world):
        assert re.search(rf"rank {rank} [\d.]+ [KM]iB predicted, [\d.]+ [KM]iB measured", line)


def test_a_traced_pipeline_run_draws_its_measured_grid(tmp_path, capsys):
    """--trace on 2 ranks, 2 steps: every item of both steps traced, measured back (bubble
    in [0, 1), a mean cost for every kind and stage), and drawn beside its prediction."""
    from schedc.analysis.pipeline_trace import load, measure
    from schedc.compiler import compile_file

    pipe, trace = PIPELINE / "tiny_pp2_interleaved.sched", tmp_path / "t.json"
    r = torchrun(2, str(pipe), "--steps", "2", "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    c = compile_file(str(pipe))
    programs = c.pipeline.programs
    assert f"trace written to {trace} ({2 * sum(map(len, programs.values()))} item spans)" in (
        r.stdout
    )
    t = load(str(trace), programs, 1)
    assert t.steps == [0, 1]
    m = measure(t.spans, programs, 1)
    assert all(0 <= b < 1 for b in m.bubble.values())
    assert sorted(m.costs()) == sorted((k, s) for k in (Kind.F, Kind.B) for s in range(4))
    out = tmp_path / "m.dot"
    argv = ["render", str(pipe), "--trace", str(trace), "--compare", "-o", str(out)]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert said.count("tiny_pp2_interleaved.sched: step ") == 2
    dot = out.read_text()
    assert "measured: step 1 of t.json" in dot and "predicted at step 1's measured" in dot
