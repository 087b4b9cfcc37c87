"""The simulator and what it predicts: program order and events kept on every stream, the
cost model's durations, and the verdicts on overlap: which collectives a schedule hides
behind compute and which it exposes."""

from __future__ import annotations

import itertools

import pytest

from schedc.analysis.cost import CostModel, duration
from schedc.analysis.overlap import overlap
from schedc.analysis.simulate import simulate
from schedc.compiler import compile_file, compile_text
from schedc.ir.op import Kind, Op
from schedc.lang.resources import bundled_schedules
from tests.goldens import REPO

SCHEDULES = bundled_schedules()
IDS = [p.stem for p in SCHEDULES]


def sched(name: str):
    return compile_file(REPO / "schedules" / f"{name}.sched")


@pytest.mark.parametrize("path", SCHEDULES, ids=IDS)
def test_simulation_keeps_program_order_and_events(path):
    c = compile_file(path)
    tl = simulate(c)
    at = {i.op: i for i in tl.intervals}
    assert set(at) == set(c.plan().ops)
    for s in tl.streams:
        lane = tl.on(0, s)
        assert [i.op for i in lane] == [op for op in c.plan().ops if at[op].stream == s]
        assert all(a.end <= b.start + 1e-15 for a, b in itertools.pairwise(lane))
    for u, v in c.graph().events():
        assert at[u].end <= at[v].start + 1e-15, (u, v)
    for x in overlap(tl)[0].items:
        assert x.hidden >= 0 and x.exposed >= -1e-15
        assert x.hidden + x.exposed == pytest.approx(x.interval.length)


def test_cost_model_durations():
    c = sched("ddp_overlap")
    spec, cost = c.spec, CostModel()
    f = spec.model.layer_fwd_flops("h.1", spec.micro * spec.seq_len, spec.seq_len)
    assert duration(spec, Op.parse("fwd[h.1]@mb0"), cost) == pytest.approx(f / 300e12)
    assert duration(spec, Op.parse("bwd[h.1]@mb0"), cost) == pytest.approx(2 * f / 300e12)
    b1 = next(b for b in spec.strategy.buckets if b.name == "b1")
    assert duration(spec, Op.parse("allreduce[b1]@mb3"), cost) == pytest.approx(
        10e-6 + 2 * 7 / 8 * b1.nbytes / 100e9
    )


def test_cost_model_rates_and_bytes_follow_the_numerics():
    """bf16 compute runs at the bf16 rate, fp32 at TF32's unless `tf32 off`; `--flops` is
    the rate of whatever the schedule computes in; a bf16 all-reduce moves half the bytes."""
    base = (REPO / "schedules" / "ddp_overlap.sched").read_text()
    cost = CostModel()
    for extra, rate in (("", 300e12), ("tf32 off\n", 40e12), ("precision bf16\n", 600e12)):
        spec = compile_text(base + extra).spec
        f = spec.model.layer_fwd_flops("h.1", spec.micro * spec.seq_len, spec.seq_len)
        fwd = Op.parse("fwd[h.1]@mb0")
        assert duration(spec, fwd, cost) == pytest.approx(f / rate), extra
        assert duration(spec, fwd, cost.with_(flops=50e12)) == pytest.approx(f / 50e12), extra
    fp32, bf16 = (compile_text(base + x).spec for x in ("", "precision bf16 { reduce = bf16 }\n"))
    ar = Op.parse("allreduce[b1]@mb3")
    assert duration(bf16, ar, cost) - 10e-6 == pytest.approx((duration(fp32, ar, cost) - 10e-6) / 2)
    assert cost.describe(bf16.numerics).startswith("600 TFLOP/s compute (bf16), ")


def test_ddp_overlap_bucket1_hidden_bucket2_exposed():
    """Seed 003 under the default cost model: b1 is all-reduced while bwd h.1 and h.0 compute
    (its interval lies inside theirs, so it is entirely hidden); b2 starts after the last
    backward (bwd[embed]) has ended, and the optimizer waits for it: entirely exposed."""
    c = sched("ddp_overlap")
    tl = simulate(c)
    ov = overlap(tl)[0]
    b1, b2 = tl.find("allreduce[b1]@mb3"), tl.find("allreduce[b2]@mb3")
    h1, h0 = tl.find("bwd[h.1]@mb3"), tl.find("bwd[h.0]@mb3")
    assert h1.start <= b1.start and b1.end <= h0.end
    assert ov.of("allreduce[b1]@mb3").exposed == pytest.approx(0, abs=1e-12)
    last_bwd = max(i.end for i in tl.intervals if i.op.kind is Kind.BWD)
    assert b2.start >= last_bwd
    assert ov.of("allreduce[b2]@mb3").hidden == 0
    assert tl.find("optimizer.step").start >= b2.end
    assert ov.exposed == pytest.approx(b2.length)


def _fsdp(prefetch: int):
    text = (REPO / "schedules" / "fsdp_prefetch.sched").read_text()
    text = text.replace("prefetch forward 1", f"prefetch forward {prefetch}")
    text = text.replace("prefetch backward 1", f"prefetch backward {prefetch}")
    return compile_text(text, "fsdp_prefetch.sched")


def _gathers(c):
    tl = simulate(c)
    kept = {u.name for u in c.spec.strategy.units if u.keep}
    return {
        str(x.interval.op): x for x in overlap(tl)[0].items if x.interval.op.kind is Kind.ALLGATHER
    }, kept


def test_fsdp_without_prefetch_every_gather_is_exposed():
    """prefetch 0: every all-gather of a unit that is not kept gathered starts only after the
    previous unit is freed, so compute waits for all of it: hidden time exactly 0."""
    gathers, kept = _gathers(_fsdp(0))
    others = {k: x for k, x in gathers.items() if x.interval.op.target not in kept}
    assert len(others) == 6  # u1, u2, u3 forward and backward
    for name, x in others.items():
        assert x.hidden == 0 and x.exposed > 0, name


def test_fsdp_prefetch_hides_all_gathers_but_the_step_start():
    """prefetch 1: exposed are exactly the gathers nothing can overlap: the kept tied weight's
    and u1's at the very start of the step, and u3's backward gather, which cannot start
    before u3's forward free (reshard_after_forward) and is what backward starts with.
    Every other gather is entirely hidden behind the previous unit's compute."""
    gathers, _ = _gathers(_fsdp(1))
    exposed = {k for k, x in gathers.items() if x.exposed > 1e-12}
    assert exposed == {"allgather[tied]@mb0:fwd", "allgather[u1]@mb0:fwd", "allgather[u3]@mb0:bwd"}
    for k in exposed:
        assert gathers[k].hidden == 0, k
    for k in set(gathers) - exposed:
        assert gathers[k].exposed == pytest.approx(0, abs=1e-12), k
    assert len(gathers) - len(exposed) == 4


def test_prefetch_shortens_the_predicted_step():
    step0 = overlap(simulate(_fsdp(0)))[0]
    step1 = overlap(simulate(_fsdp(1)))[0]
    assert step1.step < step0.step and step1.exposed < step0.exposed


PER_RANK = """\
model nano world 2 batch 8 x 32 micro 2
ddp { bucket b1 = head, h.1  bucket b2 = h.0, embed }
program comm on rank 1 {
  allreduce[b1]@mb1 after bwd[embed]@mb1
  allreduce[b2]@mb1
}
"""


def test_plans_that_differ_by_rank_simulate_every_rank():
    """Rank 1 holds b1 back until its last backward; rank 0 cannot all-reduce without it."""
    c = compile_text(PER_RANK, "r.sched")
    tl = simulate(c)
    assert tl.ranks == (0, 1) and not tl.every_rank
    last_bwd = tl.find("bwd[embed]@mb1", rank=1).end
    for r in (0, 1):
        assert tl.find("allreduce[b1]@mb1", rank=r).start == pytest.approx(last_bwd)
    assert simulate(c, ranks=[1]).ranks == (1,)
