"""The search behind `schedc tune`: its bounds really bound, pruning never changes the
answer, and each candidate is an ordinary schedule the compiler judges.

Every candidate of a small space is compiled and simulated here (the exhaustive answer)
and compared with what the pruned search returns.
"""

from __future__ import annotations

import pytest

from schedc.analysis.cost import CostModel
from schedc.analysis.simulate import simulate
from schedc.compiler import compile_text
from schedc.lang.diagnostics import CompileError
from schedc.tune.search import Candidate, Options, Probe, family, search
from schedc.tune.space import Base, Knobs, candidates, micros, partitions
from tests.analysis.test_cost_terms import TRUE as CPU  # every term of the cost model set
from tests.goldens import REPO

NANO = """\
# a nano model on two ranks; tune searches everything below the batch
model nano
world 2
batch 8 x 32
steps 3
seed 7
data corpus
optimizer adamw { lr = 1e-3 }
micro 2
ddp { bucket_cap 1 MiB }
"""


@pytest.fixture
def base(tmp_path) -> Base:
    p = tmp_path / "nano.sched"
    p.write_text(NANO)
    return Base.read(p)


def everything(base: Base, options: Options) -> list[Candidate]:
    """Every candidate compiled and simulated: what the pruned search must agree with."""
    first = Knobs("ddp", 1, layout="one")
    probe = Probe(base, first, options)
    out = []
    for k in candidates(probe.spec.model.n_layer, probe.spec.seqs, probe.spec.world):
        lb_t, lb_m = probe.bounds(k)
        c = Candidate(k, base.text(k, probe.spec.model, None), lb_t, lb_m)
        c.compiled = compile_text(c.text, "nano.sched")
        c.peak, c.activations = c.compiled.memory.peak, c.compiled.memory.activations
        c.step = simulate(c.compiled, options.cost).end
        out.append(c)
    return out


def test_the_space_has_every_micro_size_and_partition():
    assert micros(16, 2) == [8, 4, 2, 1]
    assert micros(512, 8) == [64, 32, 16, 8, 4, 2, 1]
    assert len(partitions(4)) == 8  # all contiguous groupings of 4 blocks
    assert len(partitions(12)) == 12  # past 16 groupings: the balanced one per unit count
    for groups in partitions(12):
        covered = [i for a, b in groups for i in range(a, b + 1)]
        assert covered == list(range(12))


@pytest.mark.parametrize(
    ("policy", "cost"),
    [
        ("", CostModel()),
        ("precision bf16\n", CostModel()),
        ("precision bf16 { reduce = bf16 }\n", CostModel()),
        ("", CPU),
    ],
)
def test_every_candidate_compiles_and_the_bounds_hold(tmp_path, policy, cost):
    """The pruning is sound only if no candidate beats its bounds: time <= simulated step,
    memory <= predicted peak (activations included), for every one (in each dtype arrangement: the
    bounds count casts where gather and reduce dtypes differ; with a CPU's cost model, every
    term of the cost model priced)."""
    p = tmp_path / "nano.sched"
    p.write_text(NANO + policy)
    base = Base.read(p)
    every = everything(base, Options(cost=cost))
    assert len(every) > 50
    assert {c.knobs.strategy for c in every} == {"ddp", "fsdp"}
    for c in every:
        assert c.lb_time <= c.step * (1 + 1e-9), c.knobs
        assert c.lb_memory <= c.peak, c.knobs


@pytest.mark.parametrize("top", [1, 3, 8])
def test_pruning_never_changes_the_answer(base, top):
    every = everything(base, Options())
    res = search(base, Options(top=top))
    families: dict = {}
    for c in every:  # the best of each family (the knobs but the unit partition)
        f = family(c.knobs)
        if f not in families or c.step < families[f].step:
            families[f] = c
    # a family whose best is another's plan is that schedule again: counted once
    plans = {(tuple(c.compiled.plan().instrs), c.peak): c.step for c in families.values()}
    want = sorted(round(s, 12) for s in plans.values())[:top]
    assert [round(c.step, 12) for c in res.ranked] == want
    assert res.considered == len(every)
    assert res.pruned_time > 0  # the bound did work
    assert res.simulated + res.duplicates + res.pruned_time == res.considered
    assert len({family(c.knobs) for c in res.ranked}) == len(res.ranked)


def test_a_budget_keeps_only_what_fits_and_the_bound_drops_some_uncompiled(base):
    every = everything(base, Options())
    sizes = sorted({c.peak for c in every})
    budget = sizes[len(sizes) // 2]
    res = search(base, Options(budget=budget, top=50))
    fits = [c for c in every if c.peak <= budget]
    assert res.ranked and all(c.peak <= budget for c in res.ranked)
    assert round(res.ranked[0].step, 12) == min(round(c.step, 12) for c in fits)
    assert res.pruned_memory > 0


def test_nothing_fits_names_the_least_peak_of_all(base):
    every = everything(base, Options())
    least = min(c.peak for c in every)
    res = search(base, Options(budget=least - 1))
    assert res.ranked == []
    assert res.smallest_peak.peak == least


def test_the_checker_refuses_are_counted_by_code(tmp_path):
    """The budget goes into every candidate as `memory`: where the memory bound is loose
    (FSDP), a candidate whose predicted peak is over the budget reaches the compiler, and the
    checker's own rule refuses it. (Short sequences: activations small beside the states.)"""
    p = tmp_path / "short.sched"
    p.write_text(NANO.replace("batch 8 x 32", "batch 8 x 2"))
    base = Base.read(p)
    every = everything(base, Options())
    loose = [c for c in every if c.lb_memory < c.peak]
    assert loose
    budget = loose[0].peak - 1
    res = search(base, Options(budget=budget, budget_text=f"{budget} B", top=10_000))
    assert res.refused["memory-budget"] > 0
    with pytest.raises(CompileError) as e:
        compile_text(base.text(loose[0].knobs, None, f"{budget} B"))
    assert "memory-budget" in e.value.render()


def test_kept_lines_keep_their_positions(tmp_path):
    """A mistake in what tune keeps is reported at the user's line and column."""
    p = tmp_path / "bad.sched"
    p.write_text(NANO.replace("lr = 1e-3", "lr = -1"))
    base = Base.read(p)
    with pytest.raises(CompileError) as e:
        search(base)
    line = NANO.splitlines().index("optimizer adamw { lr = 1e-3 }") + 1
    assert f"bad.sched:{line}:" in e.value.render()


def test_the_file_is_kept_without_what_tune_searches(base):
    text = base.kept_text(blank=False)
    assert "micro" not in text and "ddp" not in text
    assert "model nano" in text and "optimizer adamw { lr = 1e-3 }" in text
    assert len(base.kept_text(blank=True)) == len(NANO)


def test_a_mesh_goes_with_the_strategy_tune_replaces(tmp_path):
    """tune searches flat DDP and FSDP layouts: a file's `mesh` is dropped with its block
    (a DDP candidate takes no shard mesh), and every candidate compiles."""
    p = tmp_path / "hsdp.sched"
    p.write_text(
        NANO.replace("world 2", "world 4\nmesh 2 x 2").replace(
            "ddp { bucket_cap 1 MiB }",
            "fsdp { unit all = wte.weight, wpe.weight, h.0 .. h.1, head }",
        )
    )
    base = Base.read(p)
    assert "mesh" not in base.kept_text(blank=False)
    res = search(base, Options(strategies=("ddp", "fsdp")))
    assert res.ranked and not res.refused
    assert {c.knobs.strategy for c in res.ranked} <= {"ddp", "fsdp"}


def test_a_micro_steps_own_cost_ranks_the_larger_micro_size_first():
    """With only FLOPs priced, micro 1, 2 and 4 tie (the same tokens a step); a calibration
    that fits a backward's gradient bytes and the per-op overhead (`schedc run --probe`,
    docs/tune.md) charges each extra micro-step at least the head's tied-weight gradient,
    so micro 4 (k = 1) ranks first and micro 1 (k = 4) last."""
    from dataclasses import replace

    from schedc.analysis.cost import grad_bytes
    from schedc.ir.op import Op

    base = Base.read(REPO / "docs" / "tune" / "mini.sched")
    best = {}
    for name, cost in (("flops", replace(CPU, grad_bandwidth=None, overhead=0.0)), ("cpu", CPU)):
        res = search(base, Options(cost=cost, top=40, strategies=("ddp",)))
        best[name] = {}
        for c in res.ranked:  # best first: the first of each micro size is its best
            best[name].setdefault(c.knobs.micro, c.step)
    flops, cpu = best["flops"], best["cpu"]
    assert set(flops) == set(cpu) == {1, 2, 4}
    assert max(flops.values()) - min(flops.values()) < 1e-3 * min(flops.values())
    spec = compile_text((REPO / "docs" / "tune" / "mini.sched").read_text()).spec
    head = grad_bytes(spec, Op.parse("bwd[head]@mb0")) / CPU.grad_bandwidth
    assert cpu[2] - cpu[4] >= head and cpu[1] - cpu[2] >= 2 * head
