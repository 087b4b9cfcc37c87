"""A pipeline's programs bound to every global rank: the plans the proof (passes/prove.py)
executes, in the one instruction form of ir/plan.py and with the operands of ir/bound.py.

Global rank g = p x dp + d runs pipeline rank p's program on replica d's slice of the batch
(ir/spec.py PipelineSpec, pp-outermost). Its plan, on the compute stream as the executor
issues it (exec/pipeline.py: the host runs an item at a time; a receive is waited for by the
compute that reads it, which the proof models as the receive's pending buffer):

    run F[s]@j, B[s]@j, I[s]@j, W[s]@j      the program's computes, in its order
    run SEND_F[s]@j ... RECV_B[s]@j          its transfers, each with the pair of global
                                             ranks (sender, receiver) as its group
    run allreduce[<bucket>]@mb{m-1}          dp > 1: each DDP bucket of the rank's stages,
                                             right after the action that last writes it
                                             (pipelining's REDUCE_GRAD), over the ranks
                                             holding it in every replica, each share / dp
    run allreduce[wte.weight]@mb{m-1}        the tied embedding's two copies (first stage's
                                             embed, last stage's head, on two ranks) summed
                                             over that pair of the replica, before the update
    run optimizer.step

with the operands: the replica's batch slices (model/batching.py sequence_ids for rank d of
dp), the loss scale 1/m on the last stage's loss, the rank's parameters and its buckets
(passes/pipeline_memory.py `stage_buckets`: a ddp block's buckets held here, ir/spec.py
`rank_buckets`, or one a stage, as the ledger counts them). FSDP per stage is not bound
yet (`binds`).
"""

from __future__ import annotations

from fractions import Fraction

from schedc.ir.bound import Bound
from schedc.ir.op import COMPUTE, STEP, Kind, Op
from schedc.ir.pipeline import Item, Pipeline, last_grad_writers
from schedc.ir.plan import Action, Instr, Plan
from schedc.ir.spec import TIED, Spec
from schedc.model.batching import sequence_ids
from schedc.passes.pipeline_memory import stage_buckets, stage_params


def binds(spec: Spec) -> bool:
    """Whether the pipeline's plans can be bound and proven (not yet FSDP per stage)."""
    return spec.pipeline is not None and not spec.pipeline.units


def bind_pipeline(spec: Spec, pipe: Pipeline, programs: dict[int, list[Item]]) -> list[Bound]:
    """Every global rank's bound plan, in rank order (the module docstring)."""
    return [bind_rank(spec, pipe, programs, g) for g in range(pipe.pp * spec.dp)]


def bind_rank(spec: Spec, pipe: Pipeline, programs: dict[int, list[Item]], me: int) -> Bound:
    """Global rank `me`'s bound plan: what its executor runs."""
    dp, m = spec.dp, pipe.microbatches
    p, d = divmod(me, dp)
    program = programs[p]
    held = _held(spec, pipe, p)
    buckets, after = _buckets(spec, pipe, program, p)
    replicas = tuple(p * dp + r for r in range(dp))
    instrs: list[Instr] = []
    for item in program:
        for op in item:
            instrs.append(Instr(Action.RUN, COMPUTE, op, group=_pair(pipe, op, me, dp, d)))
            for b in after.get(op, ()) if dp > 1 else ():
                reduce = Op(Kind.ALLREDUCE, b, m - 1)
                instrs.append(Instr(Action.RUN, COMPUTE, reduce, group=replicas, divisor=dp))
    first, last = pipe.rank_of(0), pipe.rank_of(pipe.stages - 1)
    if first != last and p in (first, last):
        pair = (first * dp + d, last * dp + d)
        instrs.append(Instr(Action.RUN, COMPUTE, Op(Kind.ALLREDUCE, TIED, m - 1), group=pair))
    instrs.append(Instr(Action.RUN, COMPUTE, STEP))
    plan = Plan(me, (COMPUTE,), tuple(instrs), {}, {})
    B, S = spec.micro, spec.seqs
    batch = tuple((ids.start, len(ids)) for ids in (sequence_ids(0, d, j, B, dp, S)
                                                    for j in range(m)))  # fmt: skip
    return Bound(me, plan, batch, Fraction(1, m), buckets, params=held)


def _pair(pipe: Pipeline, op: Op, me: int, dp: int, d: int) -> tuple[int, ...]:
    """A transfer's group: (sender, receiver) in global ranks, the same on both ends."""
    if not op.kind.is_p2p:
        return ()
    peer = pipe.peer(op) * dp + d
    return (me, peer) if op.kind.is_send else (peer, me)


def _held(spec: Spec, pipe: Pipeline, p: int) -> tuple[str, ...]:
    """The parameters pipeline rank `p` holds, in the model's order: its stages' (the tied
    wte once, the head's copy where it has the head but not the embed)."""
    names = {q for s in pipe.stages_of(p) for q in stage_params(spec, s)}
    return tuple(q.name for q in spec.model.params if q.name in names)


def _buckets(
    spec: Spec, pipe: Pipeline, program: list[Item], p: int
) -> tuple[dict[str, tuple[str, ...]], dict[Op, list[str]]]:
    """The rank's buckets (name -> parameters, passes/pipeline_memory.py `stage_buckets`,
    what the ledger counts) and, per action, those it completes in launch order: each right
    after the last backward that writes one of its parameters."""
    assert spec.pipeline is not None
    ps, stages = spec.pipeline, pipe.stages_of(p)
    writers = last_grad_writers(program)
    index = {a: i for i, item in enumerate(program) for a in item}
    block = {q: b.name for b in ps.buckets for q in b.params}  # a ddp block's names
    out: dict[str, tuple[str, ...]] = {}
    after: dict[Op, list[str]] = {}
    for s in stages:
        for bucket in stage_buckets(spec, s, stages):
            own = next((q for q in bucket if q != TIED), TIED)  # the head's copy: its bucket
            name = block[own] if ps.buckets else ps.stages[s].name
            out[name] = tuple(bucket)
            done = [writers[t] for t in stages if set(bucket) & set(stage_params(spec, t))]
            after.setdefault(max(done, key=index.__getitem__), []).append(name)
    return out, after
