"""A per-rank plan: one rank's instructions in host issue order, with events.

A plan is what both backends execute, unchanged:

    run    <stream> <op>     issue the op on its stream (keeping alive what it reads that
                             another stream allocated: `Instr.keeps`, ir/effects.py)
    record <stream> e<i>     mark the point after the producer on the producer's stream
    wait   <stream> e<i>     make the consumer's stream wait for that point

One event has no producer op: the step start (`step_start`), recorded on compute at the
head of the plan and waited for at the head of every comm stream.

`passes.lower` makes plans; the executor, the checker, the simulator and the dumps read them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum

from schedc.ir.op import Op


class Action(Enum):
    """What an instruction does on its stream."""

    RUN = "run"
    RECORD = "record"
    WAIT = "wait"


@dataclass(frozen=True)
class Instr:
    kind: Action
    stream: str
    op: Op | None = None  # run
    event: int | None = None  # record / wait
    # run: buffers another stream allocated that this op reads, kept alive on its stream
    # until its work is done (ir/effects.py; CUDA's record_stream; not in the text form)
    keeps: tuple[str, ...] = ()
    # a collective of a plan bound to its rank (ir/bound.py): the ranks of its process
    # group in group order (a reduce-scatter's chunk p goes to group[p]), and for a
    # reduction the divisor of each member's contribution; not in the text form
    group: tuple[int, ...] = ()
    divisor: int = 1
    # a pipeline transfer posted together with the transfer before it (one item of its
    # program: one batch_isend_irecv); not in the text form
    batched: bool = False

    def __str__(self) -> str:
        if self.kind is Action.RUN:
            return f"run    {self.stream:<8} {self.op}"
        return f"{self.kind.value:<6} {self.stream:<8} e{self.event}"


@dataclass(frozen=True)
class Plan:
    rank: int | None  # None: the plan every rank without programs of its own runs
    streams: tuple[str, ...]
    instrs: tuple[Instr, ...]
    producers: dict[int, Op]  # event -> the op it follows
    consumers: dict[int, tuple[Op, ...]]  # event -> the ops that wait for it
    # the event recorded on compute before the step's first op, waited for at the head of
    # every comm stream (None: no comm stream); not in producers or consumers
    step_start: int | None = None

    @property
    def ops(self) -> list[Op]:
        return [i.op for i in self.instrs if i.op is not None]  # the runs'

    def collectives(self, stream: str | None = None) -> list[Op]:
        return [
            i.op
            for i in self.instrs
            if i.op is not None and i.op.is_collective and (stream is None or i.stream == stream)
        ]

    def collective_digest(self) -> str:
        """Hash of each stream's collective sequence: ranks compare it before step 1."""
        text = "\n".join(
            f"{i.stream} {i.op}" for i in self.instrs if i.op is not None and i.op.is_collective
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def render(self, mark: int | None = None) -> str:
        """The plan as text; `mark` points at one instruction (a failure, say)."""
        who = "every rank" if self.rank is None else f"rank {self.rank}"
        n_ops = sum(1 for i in self.instrs if i.kind is Action.RUN)
        n_streams, n_events = len(self.streams), len(self.producers)
        lines = [
            f"# plan for {who}: {n_ops} ops on {n_streams} stream{'s' * (n_streams != 1)} "
            f"({', '.join(self.streams)}), {n_events} event{'s' * (n_events != 1)}"
            + (" and the step start" if self.step_start is not None else "")
        ]
        for k, ins in enumerate(self.instrs):
            text = f"{k:5d}  {ins}"
            if ins.event is not None and ins.event == self.step_start:
                text += "    # step start" if ins.kind is Action.RECORD else "    # for step start"
            elif ins.event is not None:
                after = "after" if ins.kind is Action.RECORD else "for"  # a record, a wait
                text += f"    # {after} {self.producers[ins.event]}"
            if k == mark:
                text += "    <-- ERROR HERE"
            lines.append(text)
        return "\n".join(lines)
