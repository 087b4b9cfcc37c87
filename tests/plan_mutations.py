"""Mutations of lowered, bound plans: the bugs a graph builder or a lowering could make, each
applied to every rank's plans of a schedule, for the proof (passes/prove.py) to refute.

A mutation takes the ranks' bound plans (ir/bound.py) and returns variants, each a list of
bound plans with one bug in them, and a label of where. Nothing here goes through the
structural rules: the proof alone must refuse each variant, with its located diagnostic.

    python bench/proof.py      # the counts per class, and the proof's cost
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from fractions import Fraction

from schedc.ir.bound import Bound
from schedc.ir.op import Kind
from schedc.ir.plan import Action, Instr, Plan
from schedc.ir.spec import Spec, Strategy

Variant = tuple[str, list[Bound]]  # (what was changed, every rank's bound plan)
CAP = 6  # variants per class and schedule, spread over the plan


def _instrs(b: Bound, instrs: list[Instr]) -> Bound:
    return dataclasses.replace(b, plan=dataclasses.replace(b.plan, instrs=tuple(instrs)))


def _spread(items: list, cap: int = CAP) -> list:
    """At most `cap` of `items`, first, last and evenly between."""
    if len(items) <= cap:
        return items
    step = (len(items) - 1) / (cap - 1)
    return [items[round(i * step)] for i in range(cap)]


def _runs(b: Bound, pred: Callable[[Instr], bool]) -> list[int]:
    return [k for k, i in enumerate(b.plan.instrs) if i.op is not None and pred(i)]


def _on_one_rank(bounds: list[Bound], rank: int, change: Callable[[Bound], Bound]) -> list[Bound]:
    return [change(b) if b.rank == rank else b for b in bounds]


def _on_every_rank(bounds: list[Bound], change: Callable[[Bound], Bound]) -> list[Bound]:
    return [change(b) for b in bounds]


# the rank a mutation changes: the last one, unless a test picks another (`on_rank`)
TARGET: ContextVar[int | None] = ContextVar("TARGET", default=None)


@contextmanager
def on_rank(rank: int) -> Iterator[None]:
    """Mutations made inside change rank `rank` (one in the middle of a large world),
    not the last one; consume the variants inside."""
    token = TARGET.set(rank)
    try:
        yield
    finally:
        TARGET.reset(token)


def _last_rank(bounds: list[Bound]) -> Bound:
    """The rank a mutation changes (`TARGET`: the last, by default)."""
    target = TARGET.get()
    return bounds[-1] if target is None else bounds[target]


def _ranks(bounds: list[Bound], n: int) -> list[Bound]:
    """Up to `n` ranks spread over the world, or the one `TARGET` picks."""
    return _spread(bounds, n) if TARGET.get() is None else [_last_rank(bounds)]


def _replicas(spec: Spec) -> int:
    """How many ranks hold each parameter (a pipeline's replicas of a stage)."""
    return spec.world // spec.pipeline.degree if spec.pipeline else spec.world


def _batch_readers(spec: Spec, bounds: list[Bound]) -> list[Bound]:
    """The ranks that read the batch: every rank, or a pipeline's first and last stages'
    (a middle stage's bound slice is its replica's, which it never reads)."""
    if spec.pipeline is None:
        return bounds
    ends = {0, len(spec.pipeline.stages) - 1}
    return [
        b
        for b in bounds
        if any(i.op is not None and i.op.kind is Kind.F and i.op.stage in ends
               for i in b.plan.instrs)
    ]  # fmt: skip


def _loss_rank(spec: Spec, bounds: list[Bound]) -> Bound:
    """The last rank that takes a loss (a pipeline's last stage: in a V, the first rank)."""
    if spec.pipeline is None:
        return _last_rank(bounds)
    last = len(spec.pipeline.stages) - 1
    return next(
        b
        for b in reversed(bounds)
        if any(i.op is not None and i.op.kind is Kind.F and i.op.stage == last
               for i in b.plan.instrs)
    )  # fmt: skip


# -- the classes ---------------------------------------------------------------------------------


def _each_run(
    bounds: list[Bound], pred: Callable[[Instr], bool], edit: Callable[[list[Instr], int], str]
) -> Iterator[Variant]:
    """The last rank's plan with `edit` applied at each (spread) run `pred` picks; `edit`
    changes the instruction list in place and says what it did."""
    b = _last_rank(bounds)
    for k in _spread(_runs(b, pred)):
        ins = list(b.plan.instrs)
        said = edit(ins, k)
        yield (
            f"{said} on rank {b.rank}",
            _on_one_rank(bounds, b.rank, lambda x, ins=ins: _instrs(x, ins)),
        )


def _drop(ins: list[Instr], k: int) -> str:
    return f"{ins.pop(k).op} dropped"


def _twice(ins: list[Instr], k: int) -> str:
    ins.insert(k + 1, ins[k])
    return f"{ins[k].op} twice"


def _halve(ins: list[Instr], k: int) -> str:
    ins[k] = dataclasses.replace(ins[k], divisor=ins[k].divisor * 2)
    return f"{ins[k].op} divides by {ins[k].divisor}"


def drop_collective(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank never issues one collective."""
    return _each_run(bounds, lambda i: i.op.is_collective, _drop)


def duplicate_collective(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank issues one collective twice."""
    return _each_run(bounds, lambda i: i.op.is_collective, _twice)


def wrong_divisor(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank divides what one reduction sends by twice its divisor."""
    return _each_run(bounds, lambda i: i.op.kind in (Kind.ALLREDUCE, Kind.REDUCESCATTER), _halve)


def wait_removed(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank's stream no longer waits for an event before it reads what the event's
    producer wrote (a wait whose stream's next op reads a buffer another stream wrote)."""
    b = _last_rank(bounds)
    waits = [
        k
        for k, i in enumerate(b.plan.instrs)
        if i.kind is Action.WAIT and i.event != b.plan.step_start and _guards_a_read(b.plan, k)
    ]
    for k in _spread(waits):
        ins = list(b.plan.instrs)
        gone = ins.pop(k)
        yield (
            f"wait {gone.stream} e{gone.event} removed on rank {b.rank}",
            _on_one_rank(bounds, b.rank, lambda x, ins=ins: _instrs(x, ins)),
        )


def _guards_a_read(plan: Plan, k: int) -> bool:
    """Whether the op after wait `k` on its stream reads what the event's producer made:
    a collective after a backward or free, a compute op after a gather or reduction, the
    update after anything."""
    wait = plan.instrs[k]
    producer = plan.producers[wait.event]
    nxt = next(
        (i.op for i in plan.instrs[k + 1 :] if i.op is not None and i.stream == wait.stream), None
    )
    if nxt is None:
        return False
    if nxt.kind is Kind.STEP:
        return True
    if nxt.is_collective:
        return producer.kind is Kind.BWD or (
            producer.kind is Kind.REDUCESCATTER and nxt.kind is Kind.ALLREDUCE
        )
    return producer.is_collective


def backward_twice(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank runs one backward twice."""
    return _each_run(bounds, lambda i: i.op.kind is Kind.BWD, _twice)


def shard_offset(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank holds (gathers from, updates) the chunk after its own."""
    if spec.kind is not Strategy.FSDP or spec.mesh.shard < 2:
        return
    b = _last_rank(bounds)
    held = ((b.shard or 0) + 1) % spec.mesh.shard
    yield (
        f"rank {b.rank} holds chunk {held}",
        _on_one_rank(bounds, b.rank, lambda x: dataclasses.replace(x, shard=held)),
    )


def stale_gather(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """Two steps unrolled into one plan, and a unit's free after its last use of the first
    step and its first gather of the second dropped on every rank: the second step reads
    the parameters gathered before the update."""
    if spec.kind is not Strategy.FSDP:
        return
    for unit in _spread([u.name for u in spec.fsdp.units], 3):
        yield (
            f"{unit} not gathered again after the update",
            _on_every_rank(bounds, lambda b, unit=unit: _stale(b, unit)),
        )


def _stale(b: Bound, unit: str) -> Bound:
    one = list(b.plan.instrs)
    frees = [
        k for k, i in enumerate(one) if i.op and i.op.kind is Kind.FREE and i.op.target == unit
    ]
    gathers = [
        k for k, i in enumerate(one) if i.op and i.op.kind is Kind.ALLGATHER and i.op.target == unit
    ]
    first = [i for k, i in enumerate(one) if k != frees[-1]]
    second = [i for k, i in enumerate(one) if k != gathers[0]]
    return dataclasses.replace(_instrs(b, first + second), steps=2)


def replicate_skipped(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """HSDP: one unit's replicate all-reduce left out on every rank."""
    if not spec.hsdp:
        return
    b = _last_rank(bounds)
    for k in _spread(_runs(b, lambda i: i.op.kind is Kind.ALLREDUCE), 3):
        op = b.plan.instrs[k].op
        yield f"{op} skipped", _on_every_rank(bounds, lambda x, op=op: _without(x, op))


def _without(b: Bound, op) -> Bound:
    return _instrs(b, [i for i in b.plan.instrs if i.op != op])


def nosync_last_skipped(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """Under no_sync, the last micro-step's collective of one bucket or unit left out on
    every rank: the update reads what one rank accumulated."""
    if not spec.no_sync or spec.world < 2:
        return
    last = spec.accum - 1
    b = _last_rank(bounds)
    kinds = (Kind.ALLREDUCE, Kind.REDUCESCATTER)
    for k in _spread(_runs(b, lambda i: i.op.kind in kinds and i.op.mb == last), 3):
        op = b.plan.instrs[k].op
        yield f"{op} skipped", _on_every_rank(bounds, lambda x, op=op: _without(x, op))


def batch_slice(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank's micro-step reads another rank's slice of the batch (one of another
    replica: a pipeline's stages of one replica read one slice)."""
    b = _last_rank(bounds)
    other = next((x for x in bounds if x.batch != b.batch), None)
    if other is None:
        return
    for m in _spread([m for m in range(spec.accum) if b.batch[m] != other.batch[m]], 3):
        batch = list(b.batch)
        batch[m] = other.batch[m]
        yield (
            f"micro-step {m} of rank {b.rank} reads rank {other.rank}'s slice",
            _on_one_rank(
                bounds, b.rank, lambda x, batch=tuple(batch): dataclasses.replace(x, batch=batch)
            ),
        )


def fold_skipped(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """Under no_sync's upcast, one unit's fold into the accumulator left out on every rank."""
    b = _last_rank(bounds)
    for layer, units in list(b.folds.items())[:3]:
        unit = units[0]

        def change(x: Bound, layer=layer, unit=unit) -> Bound:
            folds = dict(x.folds)
            folds[layer] = tuple(u for u in folds[layer] if u != unit)
            return dataclasses.replace(x, folds=folds)

        yield f"{unit} not folded after bwd[{layer}]", _on_every_rank(bounds, change)


def param_left_out(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """A parameter left out of every bucket, on every rank: its gradient is never reduced."""
    if spec.kind is Strategy.FSDP or _replicas(spec) < 2:
        return
    b = _last_rank(bounds)
    params = [p for ps in b.buckets.values() for p in ps]
    for p in _spread(params, 3):

        def change(x: Bound, p=p) -> Bound:
            return dataclasses.replace(
                x, buckets={n: tuple(q for q in ps if q != p) for n, ps in x.buckets.items()}
            )

        yield f"{p} in no bucket", _on_every_rank(bounds, change)


def loss_scaled_twice(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank applies the accumulation's 1/k twice (a divisor applied twice)."""
    if spec.accum < 2:
        return
    b = _loss_rank(spec, bounds)
    scale = b.loss_scale * Fraction(1, spec.accum)
    yield (
        f"rank {b.rank} scales its loss by {scale}",
        _on_one_rank(bounds, b.rank, lambda x: dataclasses.replace(x, loss_scale=scale)),
    )


def backward_dropped(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank skips one backward (its layer's gradient of that micro-step is lost)."""
    return _each_run(bounds, lambda i: i.op.kind is Kind.BWD, _drop)


def wrong_group(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank's collective runs over a group without one of its members."""
    b = _last_rank(bounds)
    for k in _spread(_runs(b, lambda i: i.op.is_collective and len(i.group) > 1), 3):
        ins = list(b.plan.instrs)
        group = tuple(r for r in ins[k].group if r != b.rank or r == ins[k].group[0])[:-1]
        if b.rank not in group:
            group = (b.rank,)
        ins[k] = dataclasses.replace(ins[k], group=group)
        yield (
            f"{ins[k].op} over {group} on rank {b.rank}",
            _on_one_rank(bounds, b.rank, lambda x, ins=ins: _instrs(x, ins)),
        )


# -- the shape of a step, and operands that mean nothing ----------------------------------


def _each_update(bounds: list[Bound], edit: Callable[[list[Instr], int], str]) -> Iterator[Variant]:
    """`edit` at the update of each of up to three ranks (one update a rank's step)."""
    for b in _ranks(bounds, 3):
        ins = list(b.plan.instrs)
        said = edit(ins, next(iter(_runs(b, lambda i: i.op.kind is Kind.STEP))))
        yield (
            f"{said} on rank {b.rank}",
            _on_one_rank(bounds, b.rank, lambda x, ins=ins: _instrs(x, ins)),
        )


def update_dropped(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank never updates: its replica drifts from the others (DDP accepted this)."""
    return _each_update(bounds, _drop)


def update_twice(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank steps its optimizer twice on the step's gradients."""
    return _each_update(bounds, _twice)


def after_update(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """A backward moved after the update on one rank: its gradient is made too late."""

    def edit(ins: list[Instr], k: int) -> str:
        moved = ins.pop(k)
        ins.append(moved)
        return f"{moved.op} after the update"

    return _each_run(bounds, lambda i: i.op.kind in (Kind.BWD, Kind.B, Kind.W), edit)


def forward_out_of_order(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """Two forwards of one micro-step swapped on one rank: a layer runs before its input."""
    b = _last_rank(bounds)
    ins = b.plan.instrs
    fwd = _runs(b, lambda i: i.op.kind in (Kind.FWD, Kind.F))
    pairs = [(j, k) for j, k in zip(fwd, fwd[1:]) if ins[j].op.mb == ins[k].op.mb]
    for j, k in _spread(pairs, 3):
        swapped = list(ins)
        swapped[j], swapped[k] = swapped[k], swapped[j]
        yield (
            f"{ins[k].op} before {ins[j].op} on rank {b.rank}",
            _on_one_rank(bounds, b.rank, lambda x, s=swapped: _instrs(x, s)),
        )


def slice_outside_batch(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank's micro-step reads the next step's sequences (positions past the batch)."""
    readers = _batch_readers(spec, bounds)
    if TARGET.get() is not None:
        readers = [_last_rank(bounds)]
    at = [(b, m) for b in reversed(readers) for m in range(len(b.batch))]
    for b, m in _spread(at[: max(3, len(bounds[-1].batch))], 3):
        batch = list(b.batch)
        batch[m] = (batch[m][0] + spec.seqs, batch[m][1])
        yield (
            f"micro-step {m} of rank {b.rank} reads the next step's slice",
            _on_one_rank(
                bounds, b.rank, lambda x, batch=tuple(batch): dataclasses.replace(x, batch=batch)
            ),
        )


def divisor_zero(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """A reduction whose divisor is 0 (was an internal error, not a refutation)."""

    def edit(ins: list[Instr], k: int) -> str:
        ins[k] = dataclasses.replace(ins[k], divisor=0)
        return f"{ins[k].op} divided by 0"

    return _each_run(bounds, lambda i: i.op.kind in (Kind.ALLREDUCE, Kind.REDUCESCATTER), edit)


def bucket_layout(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank lays a bucket's parameters out in another order: the flat buffers it sums
    element by element with its peers' hold other parameters at the same offsets."""
    return _reversed_layout(spec, bounds, "buckets")


def unit_layout(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """One rank lays an FSDP unit's parameters out in another order: the chunks it gathers
    and reduce-scatters with its peers hold other parameters at the same offsets."""
    return _reversed_layout(spec, bounds, "units")


def _reversed_layout(spec: Spec, bounds: list[Bound], field: str) -> Iterator[Variant]:
    """The last rank's flat layout (its bound `buckets` or `units`) of up to three of its
    buffers reversed, one at a time."""
    b = _last_rank(bounds)
    layouts = getattr(b, field)
    names = [n for n, ps in layouts.items() if len(ps) > 1 and _replicas(spec) > 1]
    for name in _spread(names, 3):
        changed = {**layouts, name: tuple(reversed(layouts[name]))}
        yield (
            f"{name} laid out in reverse on rank {b.rank}",
            _on_one_rank(bounds, b.rank, lambda x, c=changed: dataclasses.replace(x, **{field: c})),
        )


def streams_in_a_circle(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """HSDP: two collectives of two communicators, adjacent on one stream, swapped on rank a
    and on the rank d one shard and one replica on from it (2 x 2: ranks 0 and 3). Each
    communicator stays in order by itself, but a waits for its replica c, which waits for
    d, which waits for its replica b, which waits for a: a deadlock."""
    if spec.kind is not Strategy.FSDP or min(spec.mesh.replicate, spec.mesh.shard) < 2:
        return
    S = spec.mesh.shard
    a = TARGET.get() or 0
    if a % S == S - 1 or a + S + 1 >= spec.world:
        return  # no rank one shard and one replica on
    d = a + S + 1
    ins = bounds[a].plan.instrs
    colls = [k for k, i in enumerate(ins) if i.op is not None and i.op.is_collective]
    pairs = [
        (x, y)
        for x, y in zip(colls, colls[1:])
        if ins[x].stream == ins[y].stream
        and spec.dim_of(ins[x].op) != spec.dim_of(ins[y].op)
        and ins[x].op.target != ins[y].op.target  # not a unit's scatter and its all-reduce
        and all(b.plan.instrs[x].op == ins[x].op and b.plan.instrs[y].op == ins[y].op
                for b in (bounds[a], bounds[d]))
    ]  # fmt: skip
    for x, y in _spread(pairs, 3):

        def swap(b: Bound, x=x, y=y) -> Bound:
            out = list(b.plan.instrs)
            out[x], out[y] = out[y], out[x]
            return _instrs(b, out)

        yield (
            f"{ins[y].op} before {ins[x].op} on ranks {a} and {d}",
            [swap(b) if b.rank in (a, d) else b for b in bounds],
        )


def rendezvous_in_a_circle(spec: Spec, bounds: list[Bound]) -> Iterator[Variant]:
    """A pipeline's last stage runs every forward before its first backward (GPipe's order on
    one rank) where the first stage waits for a backward before it sends its next forward:
    each waits for the other's transfer (one stage a rank, each rank in order by itself)."""
    if spec.pipeline is None or len(spec.pipeline.stages) != spec.pipeline.degree:
        return
    kinds = [i.op.kind for i in bounds[0].plan.instrs if i.op is not None and i.op.kind.on_stage]
    first_b = next(n for n, k in enumerate(kinds) if k in (Kind.B, Kind.I))
    if Kind.SEND_F not in kinds[first_b:]:
        return  # every forward sent before the first backward: no circle
    b = _loss_rank(spec, bounds)
    ins = b.plan.instrs
    fwd = [i for i in ins if i.op is not None and i.op.kind in (Kind.RECV_F, Kind.F)]
    yield (
        f"rank {b.rank} runs every forward before its first backward",
        _on_one_rank(bounds, b.rank, lambda x: _instrs(x, fwd + [i for i in ins if i not in fwd])),
    )


CLASSES: dict[str, Callable[[Spec, list[Bound]], Iterator[Variant]]] = {
    "drop-collective": drop_collective,
    "duplicate-collective": duplicate_collective,
    "wrong-divisor": wrong_divisor,
    "wait-removed": wait_removed,
    "backward-twice": backward_twice,
    "shard-offset": shard_offset,
    "stale-gather": stale_gather,
    "replicate-skipped": replicate_skipped,
    "nosync-last-skipped": nosync_last_skipped,
    "batch-slice": batch_slice,
    "fold-skipped": fold_skipped,
    "param-left-out": param_left_out,
    "loss-scaled-twice": loss_scaled_twice,
    "backward-dropped": backward_dropped,
    "wrong-group": wrong_group,
    "update-dropped": update_dropped,
    "update-twice": update_twice,
    "after-update": after_update,
    "forward-out-of-order": forward_out_of_order,
    "slice-outside-batch": slice_outside_batch,
    "divisor-zero": divisor_zero,
    "bucket-layout": bucket_layout,
    "streams-in-a-circle": streams_in_a_circle,
    "unit-layout": unit_layout,
    "rendezvous-in-a-circle": rendezvous_in_a_circle,
}
