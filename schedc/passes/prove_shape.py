"""What the proof (passes/prove.py) judges of each rank's bound plan before any value is
computed: the shape of a step, and operands that mean nothing.

    shape(spec, bound)     # raises Refuted, located at the rank's instruction
"""

from __future__ import annotations

from schedc.ir.bound import Bound
from schedc.ir.effects import missing_keeps
from schedc.ir.op import Kind, Op
from schedc.ir.spec import Spec
from schedc.passes.prove_rank import Refuted


def shape(spec: Spec, b: Bound) -> None:
    """Every reduction divides by a positive count; one update a step, nothing of the step
    after it; every buffer read across streams kept alive there (each micro-step reading
    positions of the step's global batch: `inside_the_batch`, every rank's)."""
    ops = [(k, i.op, i.divisor) for k, i in enumerate(b.plan.instrs) if i.op is not None]
    for k, op, divisor in ops:
        if divisor < 1:
            raise Refuted(
                b.rank, k, f"{op} divides each member's share by {divisor}: a divisor counts "
                "ranks, at least 1"
            )  # fmt: skip
    _one_update_a_step(b, [(k, op) for k, op, _ in ops])
    _kept_alive(spec, b)


def inside_the_batch(b: Bound, seqs: int) -> None:
    for m, (first, n) in enumerate(b.batch):
        if first < 0 or n < 1 or first + n > seqs:
            raise Refuted(
                b.rank,
                None,
                f"micro-step {m} of rank {b.rank} reads positions {first} .. {first + n - 1} "
                f"of a global batch of {seqs} sequences (0 .. {seqs - 1})",
            )


def _kept_alive(spec: Spec, b: Bound) -> None:
    """Every buffer an op reads that another stream allocated is kept alive on the reader's
    stream (`Instr.keeps`, ir/effects.py): otherwise the allocator may hand its memory to
    the allocating stream's next work while the reader still reads it, a race on CUDA."""
    if len(b.plan.streams) < 2:
        return
    for m in missing_keeps(spec, b.plan.instrs):
        raise Refuted(
            b.rank,
            m.index,
            f"{b.plan.instrs[m.index].op} reads {m.buffer}, allocated on stream "
            f"'{m.allocated_on}', without keeping it alive on '{m.read_on}'",
        )


def _one_update_a_step(b: Bound, ops: list[tuple[int, Op]]) -> None:
    """A rank that never updates, or updates twice, trains wrong silently."""
    updates = [k for k, op in ops if op.kind is Kind.STEP]
    if len(updates) != b.steps:
        at = updates[b.steps] if len(updates) > b.steps else (ops[-1][0] if ops else None)
        raise Refuted(
            b.rank,
            at,
            f"rank {b.rank}'s plan updates its parameters {len(updates)} "
            f"time{'s' * (len(updates) != 1)} in {b.steps} step{'s' * (b.steps != 1)}: "
            "each step is one update",
        )
    late = [(k, op) for k, op in ops if updates and k > updates[-1]]
    if late:
        k, op = late[0]
        raise Refuted(
            b.rank, k, f"{op} runs after the step's update: the step's work comes before it"
        )
