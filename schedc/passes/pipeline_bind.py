"""A pipeline's programs bound to every global rank: the plans the proof (passes/prove.py)
executes, in the one instruction form of ir/plan.py and with the operands of ir/bound.py.

Global rank g = p x dp + d runs pipeline rank p's program on replica d's slice of the batch
(ir/spec.py PipelineSpec, pp-outermost). Its plan, on the compute stream as the executor
issues it (exec/pipeline.py: the host runs an item at a time; a receive is waited for by the
compute that reads it, which the proof models as the receive's pending buffer):

    run allgather[<unit>]@mb0:fwd          FSDP per stage: before the rank's first F, each
                                           unit it holds, over its shard group
    run F[s]@j, B[s]@j, I[s]@j, W[s]@j      the program's computes, in its order
    run SEND_F[s]@j ... RECV_B[s]@j          its transfers, each with the pair of pipeline
                                             ranks (sender, receiver) of its replica as its
                                             group: one instruction on every replica
    run allreduce[<bucket>]@mb{m-1}          DDP, dp > 1: each bucket of the rank's stages,
                                             right after the action that last writes it
                                             (pipelining's REDUCE_GRAD), over the ranks
                                             holding it in every replica, each share / dp
    run reducescatter[<unit>]@mb{m-1}        FSDP: each unit there likewise, over its shard
    run free[<unit>]@mb{m-1}:bwd             group, each share / dp, and its weights freed
    run allreduce[<unit>]@mb{m-1}            HSDP per stage: each gradient shard summed over
                                             its replicate group, in the same order, once
                                             the update waits for the reductions
    run allreduce[wte.weight]@mb{m-1}        the tied embedding's two copies (first stage's
                                             embed, last stage's head, on two ranks) summed
                                             over that pair of the replica, before the
                                             update (under FSDP its unit's shards)
    run optimizer.step

with the operands: the replica's batch slices (model/batching.py sequence_ids for rank d of
dp), the loss scale 1/m on the last stage's loss, the rank's parameters, its buckets
(passes/pipeline_memory.py `stage_buckets`: a ddp block's buckets held here, ir/spec.py
`rank_buckets`, or one a stage, as the ledger counts them) and, under FSDP, its shard: its
index in its shard group (ir/spec.py `stage_mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from schedc.ir.bound import Bound
from schedc.ir.mesh import Group, span
from schedc.ir.op import COMPUTE, STEP, Kind, Op, Phase
from schedc.ir.pipeline import Item, Pipeline, last_grad_writers
from schedc.ir.plan import Action, Instr, Plan
from schedc.ir.spec import REPLICATE, SHARD, TIED, Spec, StageUnit
from schedc.model.batching import sequence_ids
from schedc.passes.pipeline_memory import stage_buckets, stage_params


def bind_pipeline(spec: Spec, pipe: Pipeline, programs: dict[int, list[Item]]) -> list[Bound]:
    """Every global rank's bound plan, in rank order (the module docstring). The ranks of a
    pipeline rank share its instructions where their groups are the same objects (one plan
    a pipeline rank under DDP per stage, not one a global rank)."""
    memo: dict = {}
    return [bind_rank(spec, pipe, programs, g, memo) for g in range(pipe.pp * spec.dp)]


@dataclass
class _Sync:
    """A rank's collectives around its program (those before its first forward, those
    each stage op completes) and its buckets or its units."""

    before: list[Instr] = field(default_factory=list)
    after: dict[Op, list[Instr]] = field(default_factory=dict)
    buckets: dict[str, tuple[str, ...]] = field(default_factory=dict)
    replicate: tuple[int, ...] = ()  # HSDP: the ranks each gradient shard is summed over
    units: dict[str, tuple[str, ...]] = field(default_factory=dict)  # FSDP: name -> params


def bind_rank(
    spec: Spec, pipe: Pipeline, programs: dict[int, list[Item]], me: int, memo: dict | None = None
) -> Bound:
    """Global rank `me`'s bound plan: what its executor runs. `memo`, shared by the ranks of
    one compile, keeps one plan per pipeline rank and groups, and one batch per replica."""
    assert spec.pipeline is not None
    memo = {} if memo is None else memo
    dp, m, mesh = spec.dp, pipe.microbatches, spec.stage_mesh
    p, d = divmod(me, dp)
    first, last = pipe.rank_of(0), pipe.rank_of(pipe.stages - 1)
    base = p * dp  # the groups, interned (ir/mesh.py): equal ranks' groups are one object
    groups = (
        (mesh.members(d, SHARD, base), mesh.members(d, REPLICATE, base))
        if spec.pipeline.units
        else (span(base, base + dp, 1),)
    )
    tied = Group((first * dp + d, last * dp + d)) if first != last and p in (first, last) else ()
    key = ("plan", p, groups, tied)
    if key not in memo:
        memo[key] = _plan(spec, pipe, programs[p], p, groups, tied)
    instrs, sync, held = memo[key]
    if ("batch", d) not in memo:
        B, S = spec.micro, spec.seqs
        memo[("batch", d)] = tuple(
            (ids.start, len(ids)) for ids in (sequence_ids(0, d, j, B, dp, S) for j in range(m))
        )
    shard = mesh.index(d, SHARD) if spec.pipeline.units else None
    plan = Plan(me, (COMPUTE,), instrs, {}, {})
    return Bound(
        me, plan, memo[("batch", d)], Fraction(1, m), sync.buckets, shard=shard, params=held,
        units=sync.units,
    )  # fmt: skip


def _plan(spec: Spec, pipe: Pipeline, program: list[Item], p: int, groups, tied) -> tuple:
    """Pipeline rank `p`'s instructions with its data-parallel `groups` and `tied` pair,
    its sync and the parameters it holds."""
    m = pipe.microbatches
    held = held_params(spec, pipe, p)
    if spec.pipeline.units:  # type: ignore[union-attr]
        sync = _units(spec, pipe, program, p, held, *groups)
    else:
        sync = _buckets(spec, pipe, program, p, groups[0])
    instrs: list[Instr] = []
    first_f = next((a for item in program for a in item if a.kind is Kind.F), None)
    for item in program:
        for k, op in enumerate(item):
            if op == first_f:
                instrs += sync.before
            group = _pair(pipe, op, p)
            instrs.append(Instr(Action.RUN, COMPUTE, op, group=group, batched=k > 0))
            instrs += sync.after.get(op, ())
    if len(sync.replicate) > 1:  # HSDP: in the order the reduce-scatters launch
        scattered = [i.op.target for i in instrs if i.op and i.op.kind is Kind.REDUCESCATTER]
        instrs += [_run(Op(Kind.ALLREDUCE, u, m - 1), sync.replicate) for u in scattered]
    if tied:
        instrs.append(_run(Op(Kind.ALLREDUCE, TIED, m - 1), tied))
    instrs.append(Instr(Action.RUN, COMPUTE, STEP))
    return tuple(instrs), sync, held


def _run(op: Op, group: tuple[int, ...], divisor: int = 1) -> Instr:
    return Instr(Action.RUN, COMPUTE, op, group=group, divisor=divisor)


def _pair(pipe: Pipeline, op: Op, p: int) -> tuple[int, ...]:
    """A transfer's group: (sender, receiver) pipeline ranks of the rank's replica, the same
    on both ends and on every replica."""
    if not op.kind.is_p2p:
        return ()
    peer = pipe.peer(op)
    return (p, peer) if op.kind.is_send else (peer, p)


def held_params(spec: Spec, pipe: Pipeline, p: int) -> tuple[str, ...]:
    """The parameters pipeline rank `p` holds, in the model's order: its stages' (the tied
    wte once, the head's copy where it has the head but not the embed)."""
    names = {q for s in pipe.stages_of(p) for q in stage_params(spec, s)}
    return tuple(q.name for q in spec.model.params if q.name in names)


def _done_by(spec: Spec, pipe: Pipeline, program: list[Item], p: int):
    """For pipeline rank `p`'s program, a function of parameters: the action after which
    nothing writes their gradients, the last backward of the rank's stages that compute
    with one of them (the program walked once, not once a bucket or unit)."""
    writers = last_grad_writers(program)
    index = {a: i for i, item in enumerate(program) for a in item}
    stages = [(t, set(stage_params(spec, t))) for t in pipe.stages_of(p)]

    def done_by(params) -> Op:
        done = [writers[t] for t, held in stages if held.intersection(params)]
        return max(done, key=index.__getitem__)

    return done_by


def _buckets(spec: Spec, pipe: Pipeline, program: list[Item], p: int, replicas) -> _Sync:
    """DDP per stage: the rank's buckets (name -> parameters, passes/pipeline_memory.py
    `stage_buckets`, what the ledger counts), each all-reduced over the replicas right after
    the last backward that writes one of its parameters, in launch order."""
    ps, dp, m = spec.pipeline, spec.dp, pipe.microbatches
    assert ps is not None
    stages = pipe.stages_of(p)
    block = {q: b.name for b in ps.buckets for q in b.params}  # a ddp block's names
    done_by = _done_by(spec, pipe, program, p)
    sync = _Sync()
    for s in stages:
        for bucket in stage_buckets(spec, s, stages):
            own = next((q for q in bucket if q != TIED), TIED)  # the head's copy: its bucket
            name = block[own] if ps.buckets else ps.stages[s].name
            sync.buckets[name] = tuple(bucket)
            if dp > 1:
                reduce = _run(Op(Kind.ALLREDUCE, name, m - 1), replicas, dp)
                sync.after.setdefault(done_by(bucket), []).append(reduce)
    return sync


def _units(
    spec: Spec, pipe: Pipeline, program: list[Item], p: int, held, shards, replicate
) -> _Sync:
    """FSDP per stage: the units whose parameters the rank holds (the tied wte's on both
    ends), gathered over the shard group before its first forward, reduce-scattered there
    and freed after the last backward that writes them, and under HSDP each shard summed
    over the replicate group before the update."""
    assert spec.pipeline is not None
    dp, m = spec.dp, pipe.microbatches
    sync = _Sync(replicate=replicate)
    mine: list[StageUnit] = [u for u in spec.pipeline.units if set(u.params) <= set(held)]
    done_by = _done_by(spec, pipe, program, p)
    for u in mine:
        sync.units[u.name] = spec.model.flat_order(u.params)
        sync.before.append(_run(Op(Kind.ALLGATHER, u.name, 0, Phase.FWD), shards))
        done = sync.after.setdefault(done_by(u.params), [])
        done.append(_run(Op(Kind.REDUCESCATTER, u.name, m - 1), shards, dp))
        done.append(Instr(Action.RUN, COMPUTE, Op(Kind.FREE, u.name, m - 1, Phase.BWD)))
    return sync
