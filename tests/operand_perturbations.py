"""Every operand of a bound plan perturbed, one at a time: each perturbed plan is either
refuted by the proof or, run on CPU ranks with the proof bypassed, still computes the
reference's update (tests/exec/test_operands.py). That is "the plan the proof read is the plan
that runs" tested from both sides: an operand the executor uses that the proof did not
read would show as an accepted plan that runs wrong.

The operands (ir/bound.py): of every instruction kind present in the plan (record, wait,
and a run of each op kind), its stream, event, micro-step, target, group order, divisor
and keeps, where it has them; of the rank, its batch, loss scale, buckets, gradient keys,
folds, shard, steps, parameters and units. Each is changed on the last rank only, at the
first instruction of its kind, to a value the plan could hold (another of the plan's
streams, events, micro-steps or targets; the group reversed; the divisor plus one), so that
what the change means is decided by the proof and the run, not by a parser.

    perturbations(spec, bounds) -> [(label, every rank's bound plan with one change)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from fractions import Fraction

from schedc.ir.bound import Bound
from schedc.ir.op import Kind
from schedc.ir.plan import Instr
from schedc.ir.spec import Spec
from schedc.passes.symmetry import data_mesh
from tests.plan_mutations import Variant, _instrs, _on_one_rank

Change = Callable[[Bound, Instr], "Instr | None"]  # None: not applicable here


def _kind(i: Instr) -> str:
    return i.kind.value if i.op is None else i.op.kind.value


def _other(values: list, v):
    """The next value of `values` after `v` (None when there is no other)."""
    others = sorted({x for x in values if x != v}, key=str)
    later = [x for x in others if str(x) > str(v)]
    return (later or others or [None])[0]


def _stream(b: Bound, i: Instr) -> Instr | None:
    s = _other(list(b.plan.streams), i.stream)
    return None if s is None else dataclasses.replace(i, stream=s)


def _event(b: Bound, i: Instr) -> Instr | None:
    if i.event is None:
        return None
    e = _other([x.event for x in b.plan.instrs if x.event is not None], i.event)
    return None if e is None else dataclasses.replace(i, event=e)


def _mb(b: Bound, i: Instr) -> Instr | None:
    if i.op is None or len(b.batch) < 2:
        return None
    mb = (i.op.mb + 1) % len(b.batch)
    return dataclasses.replace(i, op=i.op._replace(mb=mb))


def _target(b: Bound, i: Instr) -> Instr | None:
    """Another target (a stage op: another stage) of the plan's ops of this kind."""
    if i.op is None or i.op.kind is Kind.STEP:
        return None
    field = "stage" if i.op.kind.on_stage else "target"
    same = [
        getattr(x.op, field) for x in b.plan.instrs if x.op is not None and x.op.kind is i.op.kind
    ]
    t = _other(same, getattr(i.op, field))
    return None if t is None else dataclasses.replace(i, op=i.op._replace(**{field: t}))


def _group(b: Bound, i: Instr) -> Instr | None:
    if len(i.group) < 2:
        return None
    return dataclasses.replace(i, group=tuple(reversed(i.group)))


def _divisor(b: Bound, i: Instr) -> Instr | None:
    if i.op is None or i.op.kind not in (Kind.ALLREDUCE, Kind.REDUCESCATTER):
        return None
    return dataclasses.replace(i, divisor=i.divisor + 1)


def _keeps(b: Bound, i: Instr) -> Instr | None:
    return dataclasses.replace(i, keeps=()) if i.keeps else None


INSTR: dict[str, Change] = {
    "stream": _stream,
    "event": _event,
    "mb": _mb,
    "target": _target,
    "group": _group,
    "divisor": _divisor,
    "keeps": _keeps,
}


def _moved(layouts):
    """The last name of the first layout with two or more moved to the next layout."""
    names = list(layouts)
    for a, b in zip(names, names[1:]):
        if len(layouts[a]) > 1:
            p = layouts[a][-1]
            return {**layouts, a: layouts[a][:-1], b: (*layouts[b], p)}
    return None


def _bound_changes(spec: Spec, b: Bound) -> Iterator[tuple[str, dict]]:
    if b.batch:
        first, n = b.batch[0]
        yield "batch", {"batch": ((first + 1, n), *b.batch[1:])}
    yield "loss_scale", {"loss_scale": b.loss_scale * Fraction(2)}
    if (buckets := _moved(b.buckets)) is not None:
        yield "buckets", {"buckets": buckets}
    if len(b.grad_keys) > 1:  # the first and last swapped, or (one key: no_sync) the first moved
        keys = list(b.grad_keys)
        keys[0], keys[-1] = keys[-1], keys[0]
        if keys == list(b.grad_keys):
            keys[0] += 1
        yield "grad_keys", {"grad_keys": tuple(keys)}
    if b.folds:
        layer = next(iter(b.folds))
        yield "folds", {"folds": {**b.folds, layer: ()}}
    if b.shard is not None:  # the next chunk (past the last, where a group has one)
        yield "shard", {"shard": (b.shard + 1) % max(2, data_mesh(spec).shard)}
    yield "steps", {"steps": b.steps + 1}
    if b.params:
        yield "params", {"params": b.params[:-1]}
    if (units := _moved(b.units)) is not None:
        yield "units", {"units": units}


def perturbations(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """Every operand of the last rank's bound plan changed, one at a time (the module doc)."""
    b = bounds[-1]
    first: dict[str, int] = {}
    for k, i in enumerate(b.plan.instrs):
        first.setdefault(_kind(i), k)
    for kind, k in first.items():
        for field, change in INSTR.items():
            changed = change(b, b.plan.instrs[k])
            if changed is None or changed == b.plan.instrs[k]:
                continue
            ins = list(b.plan.instrs)
            ins[k] = changed
            yield (
                f"{kind} {field} on rank {b.rank}",
                _on_one_rank(bounds, b.rank, lambda x, ins=ins: _instrs(x, ins)),
            )
    for field, values in _bound_changes(spec, b):
        yield (
            f"rank {field} on rank {b.rank}",
            _on_one_rank(bounds, b.rank, lambda x, v=values: dataclasses.replace(x, **v)),
        )


def perturbed(spec: Spec, bounds: list[Bound], label: str) -> list[Bound]:
    """The variant of `perturbations` with this label."""
    return next(v for lab, v in perturbations(spec, bounds) if lab == label)


def variant(spec: Spec, bounds: list[Bound], name: str) -> list[Bound]:
    """A wrong plan by name: `perturb LABEL` (one of `perturbations`), or a plan-mutation
    class of tests/plan_mutations.py (its first variant)."""
    from tests.plan_mutations import CLASSES

    if name.startswith("perturb "):
        return perturbed(spec, bounds, name.removeprefix("perturb "))
    return next(CLASSES[name](spec, bounds))[1]
