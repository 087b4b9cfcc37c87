"""A lane's ops as boxes, and what each box is called: consecutive forward (or backward) ops
of one micro-step that no event separates join one box (`bwd[h.1 .. embed]@mb3`) unless
--unfold; each box (or run) gets the longest label that fits its narrowest drawing on any
rank, and collectives too narrow for any label a number (`marks`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from schedc.analysis.simulate import Interval
from schedc.analysis.units import fmt_time
from schedc.compiler import Compiled
from schedc.ir.op import Kind, Op
from schedc.ir.plan import Action
from schedc.ir.spec import FSDPSpec, Spec
from schedc.viz.timeline.canvas import View, fits

ABBR = {Kind.ALLREDUCE: "AR", Kind.ALLGATHER: "AG", Kind.REDUCESCATTER: "RS"}
Lanes = dict[tuple[int, str], list["Box"]]  # (rank, stream) -> its boxes in the window
Names = dict[tuple[Op, ...], tuple[str, float]]  # Box.key -> (label, font size)


@dataclass
class Box:
    """One op on a lane, or a run of layers that nothing else waits on, drawn as one box."""

    items: list[Interval]

    @property
    def op(self) -> Op:
        return self.items[0].op

    @property
    def start(self) -> float:
        return self.items[0].start

    @property
    def key(self) -> tuple[Op, ...]:
        """What the box draws, the same on every rank that runs it: it is named once."""
        return tuple(i.op for i in self.items)

    @property
    def end(self) -> float:
        return self.items[-1].end

    def labels(self, spec: Spec) -> list[str]:
        """Candidate labels, longest first; the first that fits the box is drawn."""
        op, last = self.op, self.items[-1].op
        at = f" mb{op.mb}" if spec.accum > 1 else ""
        if len(self.items) > 1:
            k = op.kind.value
            unit = unit_of(spec, [i.op.target for i in self.items])
            if unit:  # seed 004 reads "fwd U1"
                return [
                    f"{k} {unit}{at} ({op.target} .. {last.target})",
                    f"{k} {unit}{at}",
                    f"{k} {unit}",
                    k,
                ]
            return [
                f"{k}[{op.target} .. {last.target}]@mb{op.mb}",
                f"{k} {op.target}..{last.target}",
                *([f"{k}{at}"] if at else []),
                k,
            ]
        if op.is_collective:
            tail = f":{op.phase.value}" if op.phase else ""
            return [str(op), f"{ABBR[op.kind]} {op.target}{tail}", short(op)]
        if op.kind is Kind.STEP:
            return ["optimizer.step", "optimizer", "opt"]
        if op.kind is Kind.FREE:
            return [str(op), f"free {op.target}"]
        return [str(op), f"{op.kind.value} {op.target}", op.target]

    def tooltip(self) -> str:
        ops = str(self.op) if len(self.items) == 1 else f"{self.op} .. {self.items[-1].op}"
        return (
            f"{ops}: {fmt_time(self.end - self.start)} "
            f"({fmt_time(self.start)} .. {fmt_time(self.end)})"
        )


def short(op: Op) -> str:
    """A collective's shortest name, `AR b1`: what a mark's row in the table calls it."""
    return f"{ABBR[op.kind]} {op.target}"


def unit_of(spec: Spec, layers: list[str]) -> str | None:
    """The FSDP unit (not kept gathered) whose layers these are, if there is one."""
    if not isinstance(spec.strategy, FSDPSpec):  # spec.kind is not Strategy.FSDP
        return None
    for u in spec.strategy.units:
        if not u.keep and set(layers) <= set(u.layers):
            return u.name
    return None


def boxes(c: Compiled, lane: list[Interval], rank: int, unfold: bool) -> list[Box]:
    """A lane's intervals as boxes: consecutive fwd (or bwd) ops of one micro-step join one
    box unless an event is recorded inside the run or waited for inside it."""
    plan = c.plan(rank)
    records = set(plan.producers.values())
    waits: set[Op] = set()
    pending: set[str] = set()
    for ins in plan.instrs:  # a wait belongs to the next run on its stream
        if ins.kind is Action.WAIT and ins.event != plan.step_start:
            pending.add(ins.stream)
        elif ins.kind is Action.RUN and ins.op is not None and ins.stream in pending:
            pending.discard(ins.stream)
            waits.add(ins.op)
    out: list[Box] = []
    for iv in lane:
        cur = out[-1] if out else None
        if (
            not unfold
            and cur is not None
            and iv.op.kind in (Kind.FWD, Kind.BWD)
            and cur.op.kind is iv.op.kind
            and cur.op.mb == iv.op.mb
            and cur.items[-1].op not in records
            and iv.op not in waits
        ):
            cur.items.append(iv)
        else:
            out.append(Box([iv]))
    return out


def box_width(b: Box, v: View) -> float:
    """The drawn width of a box, in points (a zero-length op is still a hairline)."""
    start, end = v.clamp(b.start, b.end)
    return max(v.x(end) - v.x(start), 0.8)


def box_names(spec: Spec, lanes: Lanes, v: View) -> Names:
    """One label per op (or run of ops) for every rank, and its font size: the longest
    candidate that fits its narrowest box on any rank, else the shortest in smaller type;
    "" where none fits (a collective then gets a mark)."""
    narrowest: dict[tuple[Op, ...], tuple[float, Box]] = {}
    for lane in lanes.values():
        for b in lane:
            w = box_width(b, v)
            if b.key not in narrowest or w < narrowest[b.key][0]:
                narrowest[b.key] = (w, b)
    out: Names = {}
    for k, (w, b) in narrowest.items():
        tries = [(t, 10.0) for t in b.labels(spec)] + [(b.labels(spec)[-1], 8.0)]
        out[k] = next(((t, size) for t, size in tries if fits(t, w, size)), ("", 10.0))
    return out


def marks(lanes: Lanes, names: Names) -> dict[Op, int]:
    """Collectives too narrow for any label, numbered 1, 2, ... by when they first start;
    the number marks the op under its box on every rank and keys its row of the table."""
    first: dict[Op, float] = {}
    for lane in lanes.values():
        for b in lane:
            if b.op.is_collective and not names[b.key][0]:
                first[b.op] = min(first.get(b.op, math.inf), b.start)
    ordered = sorted(first, key=lambda op: (first[op], str(op)))
    return {op: n for n, op in enumerate(ordered, 1)}
