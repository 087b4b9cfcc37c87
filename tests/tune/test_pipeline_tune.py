"""`schedc tune` of a pipeline file (tune/pipeline.py): the balanced split is the optimal
contiguous partition, every candidate is schedule text the compiler resolves to the knobs it
was written from, the prediction adds up as its docstring says, the budget is the ledger's,
and the CLI writes a file `schedc check` accepts. torch-free."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedc.analysis.cost import optimizer_time, ring_factor
from schedc.cli.main import main
from schedc.compiler import compile_text
from schedc.ir.op import Kind as OpKind
from schedc.ir.pipeline import Schedule
from schedc.ir.spec import TIED, Strategy
from schedc.lang.diagnostics import CompileError
from schedc.tune.pipeline import (
    PipeKnobs,
    balanced_split,
    candidates,
    even_split,
    layer_refs,
    layer_times,
    own,
    predict,
    search_pipeline,
)
from schedc.tune.space import Base
from tests.analysis.test_cost_terms import TRUE as CPU  # every term of the cost model set
from tests.goldens import REPO

DP2 = REPO / "schedules" / "pipeline" / "tiny_pp2_dp2.sched"
PP2 = """\
# two ranks, one pipeline: no replicas
model tiny
world 2
batch 8 x 64
steps 3
seed 7
data corpus
optimizer adamw { lr = 1e-3 }
pipeline {
  stage s0 = embed, h.0 .. h.1
  stage s1 = h.2 .. h.3, head
  schedule 1f1b
  microbatches 2
}
"""


def brute(weights: list[float], stages: int) -> float:
    """The least heaviest range over every cut of `weights` into `stages` contiguous ranges."""
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=8), st.data())
def test_the_balanced_split_is_the_best_contiguous_one(ws, data):
    stages = data.draw(st.integers(1, len(ws)))
    layers = tuple(f"l{i}" for i in range(len(ws)))
    split = balanced_split(layers, dict(zip(layers, map(float, ws))), stages)
    assert len(split) == stages and all(split) and sum(split, ()) == layers
    heaviest = max(sum(ws[layers.index(x)] for x in s) for s in split)
    assert heaviest == brute([float(w) for w in ws], stages)


def test_the_even_split_is_the_executors():
    layers = ("embed", "h.0", "h.1", "h.2", "h.3", "head")
    assert even_split(layers, 4) == (("embed", "h.0"), ("h.1", "h.2"), ("h.3",), ("head",))
    assert layer_refs(("embed", "h.0", "h.1", "h.3", "head")) == "embed, h.0 .. h.1, h.3, head"


@pytest.fixture(scope="module")
def dp2():
    base = Base.read(DP2)
    return base, search_pipeline(base, CPU, None)


def test_every_candidate_is_text_that_resolves_to_its_knobs(dp2):
    base, res = dp2
    assert res.considered == len(res.ranked) + sum(res.refused.values())
    assert set(res.refused) == {"pp-microbatches"}  # 1f1b, zb-h1, interleaved with m < p
    seen = set()
    for c in res.ranked:
        k, spec = c.knobs, c.spec
        assert tuple(s.layers for s in spec.pipeline.stages) == k.split
        assert spec.pipeline.degree == k.degree and spec.pipeline.schedule is k.schedule
        assert spec.pipeline.placement is k.schedule.placement
        assert c.compiled.pipeline.pipeline.microbatches == k.microbatches
        assert spec.dp == 4 // k.degree and spec.micro * k.microbatches * spec.dp == spec.seqs
        assert bool(spec.pipeline.units) == (k.sync == "fsdp")
        seen.add((k.schedule, k.sync, k.balance))
    assert {s for s, _, _ in seen} == set(Schedule)  # every named schedule ranks somewhere
    assert {y for _, y, _ in seen} == {"ddp", "fsdp"} and {b for *_, b in seen} == {
        "even",
        "balanced",
    }
    assert [c.step for c in res.ranked] == sorted(c.step for c in res.ranked)


def test_the_balanced_split_moves_layers_off_the_head():
    """The head's projection onto the vocabulary and its loss outweigh a block of tiny:
    balanced at 2 stages puts three layers before it where even puts two."""
    spec = compile_text(DP2.read_text(), str(DP2)).spec
    times = layer_times(spec, CPU, 1)
    assert times["head"][0] > times["h.0"][0]
    weights = {x: t[0] + t[1] for x, t in times.items()}
    assert [len(s) for s in balanced_split(spec.model.layers, weights, 2)] == [4, 2]


def test_gpipe_one_microbatch_adds_up(tmp_path):
    """GPipe with one micro-batch runs every stage in turn: the step is every F and B, the
    two transfers, the tied all-reduce, the norm's latency and the optimizer (no dp)."""
    path = tmp_path / "pp2.sched"
    path.write_text(PP2)
    spec = compile_text(PP2, str(path)).spec
    split = even_split(spec.model.layers, 2)
    k = PipeKnobs(2, Schedule.GPIPE, 1, 1, split, "even")
    c = compile_text(Base.read(path).pipeline_text(k.block(), None), str(path))
    got = predict(c, k, CPU)
    times = layer_times(c.spec, CPU, c.spec.micro)
    compute = sum(t[0] + t[1] for t in times.values())
    act = c.spec.micro * c.spec.seq_len * c.spec.model.n_embd * 4
    hop = CPU.latency + act / CPU.bandwidth
    wte = c.spec.model.param(TIED).numel
    tied = CPU.latency + ring_factor(OpKind.ALLREDUCE, 2) * wte * 4 / CPU.bandwidth
    s1 = sum(c.spec.model.layer_numel(x) for x in split[1]) + wte
    s0 = sum(c.spec.model.layer_numel(x) for x in split[0])
    opt = optimizer_time(Strategy.DDP, c.spec.optim.clip, max(s0, s1), CPU)
    assert got.step == pytest.approx(compute + 2 * hop + tied + CPU.latency + opt)
    assert got.comm == pytest.approx(tied)


def test_the_budget_is_the_ledgers(dp2):
    base, res = dp2
    peaks = sorted({c.peak for c in res.ranked})
    mid = peaks[len(peaks) // 2]
    fits = search_pipeline(base, CPU, f"{mid} B")
    assert fits.ranked and all(c.peak <= mid for c in fits.ranked)
    assert {c.knobs for c in fits.ranked} == {c.knobs for c in res.ranked if c.peak <= mid}
    assert fits.refused["memory-budget"] == sum(c.peak > mid for c in res.ranked)
    nothing = search_pipeline(base, CPU, f"{peaks[0] - 1} B")
    assert not nothing.ranked and isinstance(nothing.first_refusal, CompileError)


def test_the_cli_writes_a_file_check_accepts(tmp_path, capsys):
    out = tmp_path / "best.sched"
    assert main(["tune", str(DP2), "--top", "3", "-o", str(out), "--write-top", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert "pipeline candidates considered" in said and "refused by the checker" in said
    rows = [ln for ln in said.splitlines() if ln.lstrip()[:2] in ("1 ", "2 ", "3 ")]
    assert len(rows) == 3
    assert "the file's own pipeline, predicted the same way (#" in said
    own = [ln for ln in said.splitlines() if ln.startswith("own ")]
    assert len(own) == 1 and own[0].endswith("1f1b pp2 m2 as written [3+3] ddp")
    assert out.read_text().startswith("# Written by `schedc tune")
    assert (
        out.read_text().split("\n\n", 1)[1]
        == (tmp_path / "1.sched").read_text().split("\n\n", 1)[1]
    )
    assert main(["check", str(out)]) == 0
    assert f"{out}: ok" in capsys.readouterr().out


def test_fit_is_refused_for_a_pipeline_in_one_line(capsys, tmp_path):
    fit = tmp_path / "fit.json"
    assert main(["tune", str(DP2), "--measure", "1", "--fit", str(fit)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is fitted to data-parallel traces" in err
    assert not fit.exists()


@pytest.mark.torch
@pytest.mark.ranks
def test_measure_runs_the_best_pipeline_on_its_ranks(capsys, tmp_path):
    """The best candidate of a world-2 pipeline file, run for real: its measured step beside
    the prediction (at the CPU cost model's terms: the error is what it is, not a bound)."""
    src = tmp_path / "pp2.sched"
    src.write_text(PP2)
    argv = ["tune", str(src), "--top", "1", "--measure", "1", "--steps", "2", "--cost"]
    argv += [str(REPO / "docs" / "render" / "cpu_params.json"), "--strategy", "ddp"]
    assert main([*argv, "--write-top", str(tmp_path / "top")]) == 0
    out = capsys.readouterr().out
    assert "schedc: measuring 1/1: python -m schedc run " in out  # it starts its ranks
    assert "predicted vs measured (median step after the first, 2 steps each)" in out
    row = next(ln for ln in out.splitlines()[::-1] if ln.startswith("1 "))
    measured, err = row.split()[-2:]
    assert measured.endswith("ms") and err.endswith("%")
    assert re.search(r"median \|error\| [\d.]+% over 1 measured", out)
    assert (tmp_path / "top" / "1.log.jsonl").exists()


def test_the_space_skips_what_no_rank_could_hold():
    """No degree with fewer layers than stages; m divides a replica's sequences, at most 8p."""
    cfg = compile_text(DP2.read_text(), str(DP2)).spec.model
    space = candidates(cfg, 8, 64, {x: 1.0 for x in cfg.layers})
    assert {k.degree for k in space} == {2, 4}  # 6 layers: no 8 stages
    assert all(len(k.split) == k.degree * k.v <= 6 for k in space)
    for k in space:
        per_replica = 64 // (8 // k.degree)
        assert per_replica % k.microbatches == 0 and k.microbatches <= 8 * k.degree


def test_the_files_own_pipeline_is_predicted_as_its_candidate_is(dp2):
    """tiny_pp2_dp2's own block is the even 1f1b candidate at m 2: one prediction."""
    base, res = dp2
    mine = own(base, CPU, None)
    assert mine is not None and mine.knobs.balance == "as written"
    same = [
        c
        for c in res.ranked
        if (c.knobs.schedule, c.knobs.microbatches, c.knobs.split, c.knobs.sync)
        == (mine.knobs.schedule, 2, mine.knobs.split, "ddp")
    ]
    assert len(same) == 1 and same[0].step == pytest.approx(mine.step)
    assert same[0].peak == mine.peak


def test_hsdp_per_stage_is_priced_over_its_mesh(capsys):
    """tiny_pp2_hsdp's own block: each unit's gradient shard all-reduced over the 2-rank
    replicate group after its reduce-scatter (nothing for the same file sharded over all 4
    replicas, no mesh), AdamW over half a unit, where the flat one steps a quarter; tune
    says the mesh is not in its space."""
    from schedc.ir.sizes import padded
    from schedc.tune.pipeline import _collective, _replicate

    path = REPO / "schedules" / "pipeline" / "tiny_pp2_hsdp.sched"
    hsdp = own(Base.read(path), CPU, None)
    assert hsdp is not None
    flat = compile_text(path.read_text().replace("mesh 2 x 2", ""), "tiny_pp2_flat.sched")
    n = hsdp.spec.model.layer_numel("h.0")
    shard = padded(n, 2) / 2 * 4  # fp32 bytes
    assert _replicate(hsdp.spec, CPU, 2, n) == _collective(CPU, OpKind.ALLREDUCE, 2, shard)
    assert _replicate(flat.spec, CPU, 4, n) == 0.0
    assert (hsdp.spec.stage_mesh.shard, flat.spec.stage_mesh.shard) == (2, 4)
    assert predict(flat, hsdp.knobs, CPU).step < hsdp.step  # more to step, one more collective
    assert main(["tune", str(path), "--top", "1"]) == 0
    assert "`mesh 2 x 2` (HSDP) is not in its space" in capsys.readouterr().out
