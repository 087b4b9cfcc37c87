"""HSDP (issue #17): schedules on a 2-D mesh compute what one process computes.

FSDP units sharded over the shard dimension and their gradient shards all-reduced over the
replicate dimension, on real gloo ranks at worlds 4 (2 x 2) and 6 (2 x 3, 3 x 2). World 6
needs a pool of its own: six processes on a 2-core machine, so only a few cases run here.
Skipping the replicate all-reduce (tests/faults.py) must be caught; a flat FSDP schedule
and its HSDP twin agree under `compare` and make the same update.
"""

from __future__ import annotations

import pytest
from hypothesis import given, note, settings

from schedc.compiler import compile_text
from schedc.passes.agree import compare
from tests.oracle import assert_matches, assert_same_update
from tests.pool import JobFailed, Pool
from tests.strategies import examples, hsdp_cases

JOB_S = 60  # six ranks on two cores
TWIN = """\
model nano
world {world}{mesh}
batch {seqs} x 16
micro 2
seed 7
fsdp {{
  unit tied = wte.weight keep
  unit u1 = wpe.weight, h.0
  unit u2 = h.1, head
  prefetch forward 1
  prefetch backward 1
  no_sync {no_sync}
}}
"""


@pytest.fixture(scope="module")
def pool6():
    """Six real gloo ranks: worlds 4 and 6 both run on them."""
    p = Pool(6)
    yield p
    p.close()


def twin(mesh: str | None, no_sync: str = "off", world: int = 4) -> str:
    m = f"\nmesh {mesh}" if mesh else ""
    return TWIN.format(world=world, seqs=4 * world, mesh=m, no_sync=no_sync)


@pytest.mark.parametrize(
    ("mesh", "no_sync"),
    # 2 x 3 (three shards) is drawn by the generated cases below
    [("2 x 2", "off"), ("2 x 2", "on"), ("3 x 2", "on"), ("2 x 1", "off")],
)
def test_hsdp_equals_the_reference(pool6, reference, mesh, no_sync):
    r, s = (int(n) for n in mesh.split(" x "))
    world = r * s
    text = twin(mesh, no_sync, world)  # k = 2: accumulation through the replicate all-reduce
    assert_matches(pool6.run(text, world, 2, timeout=JOB_S), reference(text, 2))


@settings(max_examples=examples(6), deadline=None)
@given(case=hsdp_cases())
def test_generated_hsdp_schedules_equal_the_reference(pool6, reference, case):
    text = case.text()
    note(f"schedule (world {case.world}, mesh {case.mesh}):\n{text}")
    result = pool6.run(text, case.world, case.steps, timeout=JOB_S)
    assert_matches(result, reference(text, case.steps))


def test_a_divisor_split_between_scatter_and_replicate_runs_as_the_proof_reads_it(pool6, reference):
    """The replicate all-reduce's divisor is an operand of both sides: a plan dividing by 2
    in the reduce-scatter and by 2 in the all-reduce (world 4 as 2 x 2) is proved, and runs
    to the reference's update, bitwise the lowered plan's (powers of two divide exactly);
    the executor had ignored it and run a 2x gradient."""
    import dataclasses

    from schedc.passes.prove import prove
    from tests.faults import split_divisor

    text = twin("2 x 2")
    c = compile_text(text)
    split = [
        dataclasses.replace(b, plan=dataclasses.replace(b.plan, instrs=split_divisor(
            b.plan.instrs, c.spec.mesh)))
        for b in c.bounds
    ]  # fmt: skip
    assert split[0].plan.instrs != c.bounds[0].plan.instrs
    prove(c.spec, split)  # accepted: the same mean
    import torch

    got = pool6.run(text, 4, fault="split-replicate-divisor", timeout=JOB_S)
    assert_matches(got, reference(text, 1))
    (mine,), (lowered,) = got.steps, pool6.run(text, 4, timeout=JOB_S).steps
    assert mine.grad_norm == lowered.grad_norm
    assert all(torch.equal(mine.params[n], lowered.params[n]) for n in lowered.params)


@pytest.mark.parametrize("mesh", ["2 x 2"])
def test_skipping_the_replicate_allreduce_is_caught(pool6, reference, mesh):
    text = twin(mesh)
    ref = reference(text, 1)
    with pytest.raises(AssertionError) as caught:
        assert_matches(pool6.run(text, 4, fault="skip-replicate-allreduce", timeout=JOB_S), ref)
    assert not isinstance(caught.value, JobFailed), caught.value  # wrong numbers, not a crash
    assert_matches(pool6.run(text, 4, timeout=JOB_S), ref)  # and without it: equal


def test_flat_fsdp_and_its_hsdp_twin_agree_and_make_the_same_update(pool6):
    flat, hsdp = twin(None), twin("2 x 2")
    verdict = compare(compile_text(flat, "flat.sched").spec, compile_text(hsdp, "hsdp.sched").spec)
    assert verdict.agree, [d.message for d in verdict.diagnostics]
    assert_same_update(pool6.run(flat, 4, 2, timeout=JOB_S), pool6.run(hsdp, 4, 2, timeout=JOB_S))


def test_each_rank_moves_the_traffic_of_its_dimensions(pool6):
    """The executor's bytes per collective match the ledger's (ir/sizes.op_bytes)."""
    from schedc.ir.sizes import op_bytes

    text = twin("2 x 2")
    c = compile_text(text, "hsdp.sched")
    want: dict[str, int] = {}
    for op in c.plan(0).collectives():
        key = f"{op.kind.value}[{op.target}]"
        want[key] = want.get(key, 0) + op_bytes(c.spec, op)
    got = pool6.run(text, 4, 1, timeout=JOB_S).comm_bytes
    assert all(g == want for g in got), (got[0], want)


# -- the replicate all-reduce on a stream of its own ---------------------------------------------

SPLIT = twin("2 x 2") + "stream allreduce = ar\n"


def test_split_stream_hsdp_keeps_the_scatter_output_alive_on_the_all_reduce_stream(pool6):
    """The replicate all-reduce on stream `ar` reads the reduce-scatter's output, which the
    `comm` stream allocated: the plan keeps it alive on `ar` (CUDA's record_stream, so the
    allocator hands the block back to `comm` only once `ar` has passed that point), and the
    executor keeps exactly that tensor alive right before it all-reduces it, on every rank.
    The gradients the reduce-scatter reads are kept on `comm`, the shards on compute."""
    plan = compile_text(SPLIT, "split.sched").plan()
    ars = [i for i in plan.instrs if i.op is not None and i.op.kind.value == "allreduce"]
    assert ars and all(i.stream == "ar" and i.keeps for i in ars)
    res = pool6.run(SPLIT, 4, 1, timeout=JOB_S, fault="record-keeps")
    for rank, mem in enumerate(res.memory):
        log = mem["keeps"]
        for i in ars:
            op = str(i.op)
            kept = [
                p for kind, where, stream, p in log if (kind, where, stream) == ("keep", op, "ar")
            ]
            summed = [p for kind, where, _, p in log if (kind, where) == ("allreduce", op)]
            assert len(kept) == 1 and summed == kept, (rank, op, kept, summed)
            at = log.index(("keep", op, "ar", kept[0]))
            assert log[at + 1] == ("allreduce", op, "", kept[0])  # kept, then read
        rs = {w for kind, w, stream, _ in log if kind == "keep" and stream == "comm"}
        assert rs == {str(i.op) for i in plan.instrs if i.op and i.op.kind.value == "reducescatter"}
        step = next(i for i in plan.instrs if i.op and i.op.kind.value == "optimizer.step")
        assert [s for _, w, s, _ in log if w == "optimizer.step"] == ["compute"] * len(step.keeps)


def test_split_stream_hsdp_still_equals_the_reference(pool6, reference):
    assert_matches(pool6.run(SPLIT, 4, 2, timeout=JOB_S), reference(SPLIT, 2))
