"""Buffers read across streams are kept alive: the plan says so, and the checker proves it.

ir/effects.py says which cross-stream buffers each op writes and reads; the lowering writes
the keeps every such read needs into its instruction; `plan_invariants` (passes/buffers.py)
rejects a plan that lacks one with `[keep-alive]`, as an internal error, since no schedule
can cause it, only a broken lowering or a changed plan. The executor's side (it keeps alive
exactly what the plan says, on the reading stream) is tests/exec/test_hsdp.py's split-stream
test.
"""

from __future__ import annotations

import dataclasses

import pytest

from schedc.compiler import compile_file, compile_text
from schedc.ir.effects import required_keeps
from schedc.ir.op import COMPUTE, Kind
from schedc.lang.resources import bundled_schedules
from schedc.passes.buffers import PlanInvariantError, plan_invariants
from tests.goldens import REPO

SPLIT = (REPO / "schedules" / "tiny_hsdp.sched").read_text() + "stream allreduce = ar\n"


def _runs(plan, kind: Kind):
    return [(k, i) for k, i in enumerate(plan.instrs) if i.op is not None and i.op.kind is kind]


def test_split_stream_hsdp_keeps_the_scatter_output_on_the_all_reduce_stream():
    plan = compile_text(SPLIT, "split.sched").plan()
    for _, ins in _runs(plan, Kind.ALLREDUCE):
        assert ins.stream == "ar"
        assert ins.keeps == (f"rs_out[{ins.op.target}]@mb{ins.op.mb}",)
    for _, ins in _runs(plan, Kind.REDUCESCATTER):  # the gradient, written on compute
        assert ins.stream == "comm" and ins.keeps == (f"grad[{ins.op.target}]@mb{ins.op.mb}",)
    (_, step), units = _runs(plan, Kind.STEP)[0], ("tied", "u1", "u2", "u3")
    assert step.keeps == tuple(f"shard_grad[{u}]" for u in units)


@pytest.mark.parametrize("kind", [Kind.ALLREDUCE, Kind.REDUCESCATTER, Kind.STEP])
def test_a_plan_without_one_keep_is_rejected_with_its_code(kind):
    """The mutation: one instruction's keeps dropped; the rule names it and the buffer."""
    c = compile_text(SPLIT, "split.sched")
    plan = c.plan()
    k, ins = _runs(plan, kind)[0]
    instrs = list(plan.instrs)
    instrs[k] = dataclasses.replace(ins, keeps=ins.keeps[1:])
    broken = dataclasses.replace(plan, instrs=tuple(instrs))
    with pytest.raises(PlanInvariantError) as e:
        plan_invariants(c.spec, broken)
    assert e.value.code == "keep-alive" and e.value.index == k
    assert f"instruction {k} ({ins})" in str(e.value)
    assert f"reads {ins.keeps[0]}" in str(e.value) and str(e.value).endswith("[keep-alive]")
    plan_invariants(c.spec, plan)  # the lowered plan itself passes


def test_a_lowering_that_forgets_the_keeps_is_an_internal_error(monkeypatch, capsys):
    """Through the whole compiler and the CLI: exit 2, 'internal error', the rule's code."""
    from schedc.cli.main import main

    monkeypatch.setattr("schedc.passes.lower.required_keeps", lambda spec, instrs: {})
    with pytest.raises(PlanInvariantError, match=r"\[keep-alive\]"):
        compile_text(SPLIT, "split.sched")
    path = REPO / "schedules" / "tiny_fsdp_prefetch.sched"
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "internal error" in err and "[keep-alive]" in err


def test_a_stream_that_reads_what_it_allocated_keeps_nothing():
    """Reduce-scatters on compute read the gradient where it was written: no keep there;
    the same-stream HSDP all-reduce (tiny_hsdp as bundled) keeps nothing either."""
    text = (REPO / "schedules" / "tiny_fsdp_prefetch.sched").read_text()
    plan = compile_text(text + "stream reducescatter = compute\n", "rs.sched").plan()
    assert all(not i.keeps for _, i in _runs(plan, Kind.REDUCESCATTER))
    hsdp = compile_file(REPO / "schedules" / "tiny_hsdp.sched").plan()
    assert all(not i.keeps for _, i in _runs(hsdp, Kind.ALLREDUCE))


@pytest.mark.parametrize("path", bundled_schedules(), ids=lambda p: p.name)
def test_every_bundled_plan_carries_exactly_the_keeps_its_effects_require(path):
    c = compile_file(path)
    for plan in c.plans.values():
        want = required_keeps(c.spec, plan.instrs)
        got = {k: i.keeps for k, i in enumerate(plan.instrs) if i.keeps}
        assert got == want
        if c.spec.kind.value != "fsdp":
            assert not got  # buckets and one process's gradients live for the whole run
        for k in got:
            assert plan.instrs[k].stream != COMPUTE or plan.instrs[k].op.kind is Kind.STEP
