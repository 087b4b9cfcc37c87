"""The lifetime rules: the plan's effects (ir/effects.py) interpreted with vector clocks.

What each op allocates, reads, frees and keeps alive is said once, in ir/effects.py; the
memory ledger (passes/memory.py) interprets it with byte sizes, the executor with tensors,
and these rules with the run graph's vector clocks (passes/clocks.py):

* a gathered unit is read only while it lives: the all-gather whose buffer an op reads
  (`gathers_read`) is complete before the op starts, and the free that releases it
  (`gather_freed`) starts only after every op that reads it   [use-after-free]
  (a recompute that may run before its gather: [recompute-gather]; a reader on another
  stream than its gather with nothing ordering them: [missing-event])
* every buffer an op reads that another stream allocated is kept alive on the reading
  stream (`missing_keeps`): an invariant of every lowered plan, so a plan that breaks it
  is a bug in schedc, an internal error with its code   [keep-alive]
* the predicted peak (the ledger's) fits the declared budget   [memory-budget]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from schedc.ir.effects import gather_freed, gathers_read, missing_keeps
from schedc.ir.op import Kind, Op
from schedc.ir.plan import Plan
from schedc.ir.spec import Spec, Strategy
from schedc.lang.diagnostics import Diagnostics
from schedc.passes.graph import ScheduleGraph
from schedc.passes.memory import MemoryReport, fmt_bytes
from schedc.passes.payloads import Need, said


@dataclass(frozen=True)
class Finding:
    """A rule broken at `op` (the diagnostic's place) because of `cause`, an op of the step."""

    op: Op
    code: str
    cause: Op
    message: str
    hint: str


def gathered_findings(sg: ScheduleGraph) -> Iterator[Finding]:
    """Every read of a gathered unit outside its buffer's life, by the run graph's clocks:
    before the gather that allocates it completes, or after the free that releases it may
    have started. Runs once every op the step needs is placed, and nothing else is."""
    spec = sg.spec
    if spec.kind is not Strategy.FSDP:
        return
    readers: dict[Op, list[Op]] = defaultdict(list)  # gather -> the placed ops reading it
    for op in sg.placed():
        for gather in gathers_read(spec, op):
            readers[gather].append(op)
            if not sg.ordered(gather, op):
                yield _read_early(sg, gather, op)
    for op in sg.placed():
        if op.kind is Kind.FREE:
            for reader in readers[gather_freed(spec, op)]:
                if not sg.ordered(reader, op):
                    yield _freed_early(sg, op, reader)


def _read_early(sg: ScheduleGraph, gather: Op, op: Op) -> Finding:
    """`op` may start before `gather`, whose buffer it reads, is complete."""
    on_gather, on_op = sg.node(gather).stream, sg.node(op).stream
    cross = on_gather != on_op
    wait = f"write `{op} after {gather}`"
    if op.kind is Kind.RECOMPUTE:
        return Finding(
            op,
            "recompute-gather",
            gather,
            f"{op} reruns {op.target}'s forward before {gather} gathers '{gather.target}'",
            wait if cross else f"place {gather} before {op}",
        )
    if not cross:
        return Finding(
            op,
            "use-after-free",
            gather,
            f"{op} reads '{gather.target}' before {gather} gathers it",
            f"place {gather} before {op}",
        )
    return Finding(
        op,
        "missing-event",
        gather,
        f"{op} on stream '{on_op}' needs {gather} on stream '{on_gather}' "
        f"({said([Need.PARAMS])}) but nothing makes it wait",
        wait,
    )


def _freed_early(sg: ScheduleGraph, free: Op, reader: Op) -> Finding:
    """`free` may start while `reader` still reads the buffer it releases."""
    cross = sg.node(reader).stream != sg.node(free).stream
    return Finding(
        free,
        "use-after-free",
        reader,
        f"{free} releases '{free.target}' while {reader} may still read it",
        f"free a unit only after its last reader: place {free} after {reader}"
        + (" or wait for it" if cross else ""),
    )


# -- keep-alive: an invariant of every lowered plan ----------------------------------------------


class PlanInvariantError(AssertionError):
    """A lowered plan breaks a rule that no schedule can break, only a bug in schedc's
    lowering (or a plan changed after it): an internal error, with the rule's code."""

    def __init__(self, code: str, plan: Plan, index: int, message: str):
        self.code, self.plan, self.index = code, plan, index
        who = "every rank" if plan.rank is None else f"rank {plan.rank}"
        super().__init__(
            f"plan for {who}, instruction {index} ({plan.instrs[index]}): {message}  [{code}]"
        )


def plan_invariants(spec: Spec, plan: Plan) -> None:
    """[keep-alive]: every buffer an op reads that another stream allocated is kept alive
    on the reading stream until that op's work is done (ir/effects.py): otherwise the
    caching allocator may hand its block to new work on the allocating stream while the
    reader still reads it (HSDP's replicate all-reduce on its own stream reading the
    reduce-scatter's output, as FSDP2's `_fsdp_collectives.py` warns)."""
    for m in missing_keeps(spec, plan.instrs):
        raise PlanInvariantError(
            "keep-alive",
            plan,
            m.index,
            f"reads {m.buffer}, allocated on stream '{m.allocated_on}', without keeping it "
            f"alive on '{m.read_on}'",
        )


# -- the memory budget ----------------------------------------------------------------------------


def memory_budget(spec: Spec, report: MemoryReport, diag: Diagnostics, rank: int | None) -> None:
    """[memory-budget]: the ledger's peak for one rank's plan against the declared budget."""
    if spec.memory is None or report.peak <= spec.memory:
        return
    who = "" if rank is None else f" on rank {rank}"
    hint = "raise `memory`"
    if spec.kind is Strategy.FSDP:
        hint = "lower `prefetch forward`/`prefetch backward`, use smaller units, or " + hint
    if report.largest == "activations":
        hint = "recompute layers (`recompute h.0 .. h.N`), use a smaller `micro`, or raise " + (
            "`memory`"
        )
    at = f"at {report.peak_at}" if report.peak_at else "model states alone"
    parts = ", ".join(f"{name} {fmt_bytes(v)}" for name, v in report.parts)
    diag.error(
        "memory-budget",
        f"predicted peak {fmt_bytes(report.peak)} per rank{who} ({at}) "
        f"exceeds the budget of {fmt_bytes(spec.memory)}; the largest part is "
        f"{report.largest} ({parts})",
        spec.where.get("memory"),
        hint=hint,
    )
