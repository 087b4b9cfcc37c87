"""Binding a lowered plan to a rank: the last step of lowering (ir/bound.py says what it adds).

Every operand is worked out here, once, from the resolved schedule: the batch slice from
model/batching.py's sequence_ids, the divisors and groups from the mesh, the gradient keys
and folds from ir/effects.py. The executor runs what this returns, and the proof checks it.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from schedc.ir.bound import Bound
from schedc.ir.effects import grad_key, upcast
from schedc.ir.op import Kind
from schedc.ir.plan import Instr, Plan
from schedc.ir.spec import SHARD, DDPSpec, Spec, Strategy
from schedc.model.batching import sequence_ids


def bind(spec: Spec, plan: Plan, rank: int, memo: dict | None = None) -> Bound:
    """`plan` as rank `rank` runs it (ir/bound.py). `memo`, shared by the ranks of one
    compile, keeps one bound instruction per instruction and group, not one per rank."""
    B, D, S = spec.micro, spec.world, spec.seqs
    batch = tuple(
        (ids.start, len(ids))
        for ids in (sequence_ids(0, rank, m, B, D, S) for m in range(spec.accum))
    )
    memo = {} if memo is None else memo
    instrs = tuple(_bind(spec, plan, k, rank, memo) for k in range(len(plan.instrs)))
    bound = Bound(rank, dataclasses.replace(plan, instrs=instrs), batch, Fraction(1, spec.accum))
    if spec.kind is Strategy.FSDP:
        return dataclasses.replace(
            bound,
            grad_keys=tuple(grad_key(spec, m) for m in range(spec.accum)),
            folds=_folds(spec),
            shard=spec.mesh.index(rank, SHARD),
            units={u.name: spec.model.flat_order(u.params) for u in spec.fsdp.units},
        )
    if isinstance(spec.strategy, DDPSpec):
        buckets = {b.name: b.params for b in spec.strategy.buckets}
    else:  # one process: one flat gradient buffer of every parameter, never communicated
        buckets = {"grads": tuple(p.name for p in spec.model.params)}
    return dataclasses.replace(bound, buckets=buckets)


def _bind(spec: Spec, plan: Plan, k: int, rank: int, memo: dict) -> Instr:
    ins = plan.instrs[k]
    op = ins.op
    if op is None or not op.is_collective:
        return ins
    group = spec.mesh.members(rank, spec.dim_of(op))
    key = (id(plan), k, group)
    if key not in memo:
        memo[key] = _bound(spec, ins, group)
    return memo[key]


def _bound(spec: Spec, ins: Instr, group: tuple[int, ...]) -> Instr:
    op = ins.op
    assert op is not None
    # every gradient is averaged over the whole world: DDP's all-reduce and FSDP's
    # reduce-scatter divide by it; HSDP's replicate all-reduce then only sums
    divisor = 1
    if op.kind is Kind.REDUCESCATTER or (op.kind is Kind.ALLREDUCE and not spec.hsdp):
        divisor = spec.world
    return dataclasses.replace(ins, group=group, divisor=divisor)


def _folds(spec: Spec) -> dict[str, tuple[str, ...]]:
    """Under the upcast: layer -> the units whose last writer (lowest layer) it is."""
    if not upcast(spec):
        return {}
    out: dict[str, tuple[str, ...]] = {}
    for u in spec.fsdp.units:
        last = min(spec.writers(u.params), key=spec.model.layer_index)
        out[last] = (*out.get(last, ()), u.name)
    return out
