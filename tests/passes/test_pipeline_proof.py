"""The proof covers pipelines (passes/pipeline_bind.py, passes/prove_stage.py): every bundled
pipeline schedule's bound plans are proved to compute one process's update, and wrong plans
of the kinds a pipeline lowering gets wrong are refuted, each with a located diagnostic."""

from __future__ import annotations

import dataclasses as dc
import re
from collections.abc import Callable
from fractions import Fraction

import pytest

from schedc.compiler import compile_file
from schedc.ir.bound import Bound
from schedc.ir.op import Kind
from schedc.ir.plan import Instr
from schedc.ir.spec import TIED
from schedc.lang.diagnostics import Diagnostics
from schedc.lang.resources import pipeline_schedules
from schedc.passes.check import check_proof
from schedc.passes.pipeline_bind import bind_pipeline
from schedc.passes.prove import prove
from schedc.passes.prove_rank import Refuted
from tests.plan_mutations import CLASSES

PIPELINES = pipeline_schedules()


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_every_bundled_pipeline_is_proved(path):
    c = compile_file(path)
    assert c.proof is not None and c.spec.pipeline is not None
    line = c.proof.line()
    assert f"every update reads {c.spec.seqs:,} sequences once" in line, line
    assert re.search(rf"abstract execution of {c.spec.world} plans?, [\d.]+ ms\)$", line), line
    units = c.spec.pipeline.units
    shards = f"{len(units)} units x {c.spec.stage_mesh.shard} shards updated once"
    assert (shards in line) == bool(units), line


def test_every_kind_of_sync_per_stage_is_bundled():
    """None, DDP, FSDP and HSDP per stage: each is proved above."""
    specs = [compile_file(p).spec for p in PIPELINES]
    kinds = {(s.sync.value, s.stage_mesh.replicate > 1 and s.sync.value == "fsdp") for s in specs}
    assert {("single", False), ("ddp", False), ("fsdp", False), ("fsdp", True)} <= kinds


def _bounds(name: str):
    c = compile_file(next(p for p in PIPELINES if p.stem == name))
    assert c.pipeline is not None
    return c.spec, bind_pipeline(c.spec, c.pipeline.pipeline, c.pipeline.programs)


Edit = Callable[[list[Instr]], list[Instr]]


def _edit(b: Bound, fn: Edit) -> Bound:
    return dc.replace(b, plan=dc.replace(b.plan, instrs=tuple(fn(list(b.plan.instrs)))))


def _first(kind: Kind) -> Callable[[list[Instr]], int]:
    return lambda instrs: next(n for n, i in enumerate(instrs) if i.op.kind is kind)


def _drop(kind: Kind) -> Edit:
    def edit(instrs):
        del instrs[_first(kind)(instrs)]
        return instrs

    return edit


def _twice(kind: Kind) -> Edit:
    def edit(instrs):
        k = _first(kind)(instrs)
        instrs.insert(k + 1, instrs[k])
        return instrs

    return edit


def _i_made_b(instrs):
    k = _first(Kind.I)(instrs)
    instrs[k] = dc.replace(instrs[k], op=instrs[k].op._replace(kind=Kind.B))
    return instrs


def _reduce_early(instrs):
    """The first bucket's all-reduce right after the rank's first backward."""
    k = next(n for n, i in enumerate(instrs) if i.op.kind is Kind.ALLREDUCE)
    ins = instrs.pop(k)
    instrs.insert(_first(Kind.B)(instrs) + 1, ins)
    return instrs


def _swap(kind: Kind) -> Edit:
    """The rank's first two receives of `kind` swapped (none: as it was)."""

    def edit(instrs):
        at = [n for n, i in enumerate(instrs) if i.op.kind is kind][:2]
        if len(at) == 2:
            a, b = at
            instrs[a], instrs[b] = instrs[b], instrs[a]
        return instrs

    return edit


def _no_tied(instrs):
    return [i for i in instrs if i.op.target != TIED]


def _divisor_one(instrs):
    return [dc.replace(i, divisor=1) if i.op.kind is Kind.ALLREDUCE else i for i in instrs]


def _other_stage(world: int, dp: int) -> Edit:
    """Each bucket all-reduced over the replicas of the next pipeline rank's stages."""

    def edit(instrs):
        return [
            dc.replace(i, group=tuple((g + dp) % world for g in i.group))
            if i.op.kind is Kind.ALLREDUCE and i.op.target != TIED
            else i
            for i in instrs
        ]

    return edit


def _move(kind: Kind, to: Callable[[list[Instr]], int]) -> Edit:
    """The rank's first instruction of `kind` moved to just before index `to(instrs)` of
    the instructions without it."""

    def edit(instrs):
        ins = instrs.pop(_first(kind)(instrs))
        instrs.insert(to(instrs), ins)
        return instrs

    return edit


def _after(kind: Kind) -> Callable[[list[Instr]], int]:
    return lambda instrs: _first(kind)(instrs) + 1


def _divisor(kind: Kind, n: int) -> Edit:
    return lambda instrs: [dc.replace(i, divisor=n) if i.op.kind is kind else i for i in instrs]


def _shard_swapped(spec, bounds):
    """Replicas 0 and 1 of pipeline rank 0 hold each other's chunk."""
    return [dc.replace(b, shard=1 - b.shard) if b.rank < 2 else b for b in bounds]


def _replicate_dropped(instrs):
    """HSDP: the first gradient shard's all-reduce over its replicate group dropped."""
    k = next(n for n, i in enumerate(instrs) if i.op.kind is Kind.ALLREDUCE and len(i.group) == 2
             and i.op.target != TIED)  # fmt: skip
    del instrs[k]
    return instrs


def _every(fn: Edit):
    return lambda spec, bounds: [_edit(b, fn) for b in bounds]


def _on(rank: int, fn: Edit):
    return lambda spec, bounds: [_edit(b, fn) if b.rank == rank else b for b in bounds]


# (class, schedule, mutation of every rank's bound plans, what the refutation says)
MUTATIONS = [
    (
        "loss-scale-per-stage",  # 1/(m / stages): micro-batches counted per stage
        "tiny_pp2_dp2_ddp",
        lambda spec, bs: [dc.replace(b, loss_scale=Fraction(2, spec.accum)) for b in bs],
        "counted twice",
    ),
    ("divisor-dropped", "tiny_pp2_dp2_ddp", lambda s, bs: _every(_divisor_one)(s, bs), "twice"),
    (
        "replica-group-of-another-stage",
        "tiny_pp2_dp2_ddp",
        lambda spec, bs: _every(_other_stage(spec.world, spec.dp))(spec, bs),
        "does not hold its rank",
    ),
    (
        "batch-slice-of-another-replica",
        "tiny_pp2_dp2_ddp",
        lambda spec, bs: [dc.replace(b, batch=bs[0].batch) for b in bs],
        "of replica 1 missing",
    ),
    ("tied-sum-dropped", "tiny_pp2_dp2_ddp", lambda s, bs: _every(_no_tied)(s, bs), "missing"),
    (
        "reduced-before-last-backward",
        "tiny_pp2_dp2_ddp",
        lambda s, bs: _every(_reduce_early)(s, bs),
        "missing",
    ),
    (
        "activations-received-out-of-order",
        "tiny_pp2_dp2_ddp",
        lambda s, bs: _every(_swap(Kind.RECV_F))(s, bs),
        "receives another tensor than it names",
    ),
    (
        "gradients-received-out-of-order",
        "tiny_pp4_1f1b",
        lambda s, bs: _on(0, _swap(Kind.RECV_B))(s, bs),
        "B[s0]@mb0 reads what RECV_B[s0]@mb0 brings, which is not received here",
    ),
    ("backward-twice", "tiny_pp2_dp2_ddp", lambda s, bs: _on(2, _twice(Kind.B))(s, bs), "once"),
    ("weight-half-dropped", "tiny_pp_zb", lambda s, bs: _on(0, _drop(Kind.W))(s, bs), "missing"),
    (
        "weight-half-twice",
        "tiny_pp_zb",
        lambda s, bs: _on(0, _twice(Kind.W))(s, bs),
        "W[s0]@mb0 reads what I[s0]@mb0 keeps, which this step has not made",
    ),
    (
        "input-half-run-whole",  # a B where the schedule's I was: its W counts it again
        "tiny_pp_zb",
        lambda s, bs: _on(1, _i_made_b)(s, bs),
        "backward once",
    ),
    # FSDP and HSDP per stage
    (
        "scatter-divisor-per-shard-group",  # / S, not / dp: the replicate sum counts twice
        "tiny_pp2_hsdp",
        lambda s, bs: _every(_divisor(Kind.REDUCESCATTER, 2))(s, bs),
        "counted twice",
    ),
    (
        "scattered-before-last-backward",
        "tiny_pp2_dp2_fsdp",
        lambda s, bs: _every(_move(Kind.REDUCESCATTER, _after(Kind.B)))(s, bs),
        "missing",
    ),
    (
        "freed-before-last-backward",
        "tiny_pp2_dp2_fsdp",
        lambda s, bs: _every(_move(Kind.FREE, _first(Kind.B)))(s, bs),
        "which does not exist here",
    ),
    (
        "gather-dropped",
        "tiny_pp2_dp2_fsdp",
        lambda s, bs: _every(_drop(Kind.ALLGATHER))(s, bs),
        "which does not exist here",
    ),  # fmt: skip
    (
        "gathered-after-first-forward",
        "tiny_pp2_dp2_fsdp",
        lambda s, bs: _every(_move(Kind.ALLGATHER, _after(Kind.F)))(s, bs),
        "which does not exist here",
    ),
    ("shards-swapped", "tiny_pp2_dp2_fsdp", _shard_swapped, "the gathered unit is shuffled"),
    (
        "replicate-sum-dropped",
        "tiny_pp2_hsdp",
        lambda s, bs: _every(_replicate_dropped)(s, bs),
        "reads shard_grad[tied], which its reduce-scatter and the replicate all-reduce never "
        "landed in this step",
    ),
    (
        "tied-shard-sum-dropped",
        "tiny_pp2_dp2_fsdp",
        lambda s, bs: _every(_no_tied)(s, bs),
        "missing",
    ),
    # the shape of a step (passes/prove.py `_shape`), as for every schedule
    (
        "update-dropped",
        "tiny_pp2_dp2_ddp",
        lambda s, bs: _on(3, _drop(Kind.STEP))(s, bs),
        "rank 3's plan updates its parameters 0 times in 1 step",
    ),
    (
        "bucket-laid-out-another-way",
        "tiny_pp2_dp2_ddp",
        lambda s, bs: [
            dc.replace(b, buckets={n: ps[::-1] for n, ps in b.buckets.items()})
            if b.rank == 3
            else b
            for b in bs
        ],
        "its members lay the bucket out differently",
    ),
    (
        "targets-of-another-replica",  # the last stage's loss against rank 0's targets
        "tiny_pp2_dp2_ddp",
        lambda spec, bs: [dc.replace(b, batch=bs[0].batch) if b.rank == 3 else b for b in bs],
        "takes its loss against the targets of positions 0 .. 1 of the step's batch, but its "
        "input carries the tokens of micro-batch 0 of rank 1, positions 2 .. 3",
    ),
    (
        "rendezvous-in-a-circle",  # the first stage waits for B@0 before F@4; the last for F@4
        "tiny_pp4_1f1b",
        lambda s, bs: next(CLASSES["rendezvous-in-a-circle"](s, bs))[1],  # on rank 3
        "the ranks wait for each other forever: rank 0 stops at B[s0]@mb0, waiting for "
        "RECV_B[s0]@mb0",
    ),
    (
        "update-twice",
        "tiny_pp2_hsdp",
        lambda s, bs: _on(5, _twice(Kind.STEP))(s, bs),
        "rank 5's plan updates its parameters 2 times in 1 step",
    ),
]


@pytest.mark.parametrize("name, schedule, mutate, says", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_wrong_pipeline_plan_is_refuted(name, schedule, mutate, says):
    spec, bounds = _bounds(schedule)
    prove(spec, bounds)  # the plans as bound are right
    with pytest.raises(Refuted) as e:
        prove(spec, mutate(spec, bounds))
    assert says in e.value.message, e.value.message


def test_the_classes_are_many():
    assert len({m[0] for m in MUTATIONS}) >= 8


def test_a_refutation_is_located_at_the_pipeline_with_the_ranks_plan():
    c = compile_file(next(p for p in PIPELINES if p.stem == "tiny_pp2_dp2_ddp"))
    assert c.pipeline is not None and c.spec.pipeline is not None
    bounds = bind_pipeline(c.spec, c.pipeline.pipeline, c.pipeline.programs)
    diag = Diagnostics(c.source)
    assert check_proof(c.spec, _every(_no_tied)(c.spec, bounds), diag) is None
    (d,) = diag.errors
    assert d.code == "proof" and "wte.weight" in d.message
    assert d.span == c.spec.pipeline.where.get("schedule", c.spec.pipeline.span)
    (note,) = d.notes
    assert "plan:" in note.message and "<-- ERROR HERE" in note.message
    assert "optimizer.step" in note.message
