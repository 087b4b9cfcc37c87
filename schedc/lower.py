"""Checked graph -> Plan: one rank's instructions in host issue order, with events.

A plan is what both backends execute, unchanged:

    run    <stream> <op>     issue the op on its stream
    record <stream> e<i>     mark the point after the producer on the producer's stream
    wait   <stream> e<i>     make the consumer's stream wait for that point

Every cross-stream edge of the graph becomes exactly one `wait`, placed immediately before
its consumer's `run`, for an event recorded immediately after its producer's `run`
(ordering invariant: a record follows its producer and precedes every wait for it).
The issue order is a topological order of the run graph that prefers the canonical
sequence, so a collective is issued the moment its inputs are ready.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass

from schedc.graph import ScheduleGraph
from schedc.ir import Op


@dataclass(frozen=True)
class Instr:
    kind: str  # "run" | "record" | "wait"
    stream: str
    op: Op | None = None  # run
    event: int | None = None  # record / wait

    def __str__(self) -> str:
        if self.kind == "run":
            return f"run    {self.stream:<8} {self.op}"
        return f"{self.kind:<6} {self.stream:<8} e{self.event}"


@dataclass(frozen=True)
class Plan:
    rank: int | None  # None: the plan every rank without programs of its own runs
    streams: tuple[str, ...]
    instrs: tuple[Instr, ...]
    producers: dict[int, Op]  # event -> the op it follows
    consumers: dict[int, tuple[Op, ...]]  # event -> the ops that wait for it

    @property
    def ops(self) -> list[Op]:
        return [i.op for i in self.instrs if i.kind == "run"]

    def collectives(self, stream: str | None = None) -> list[Op]:
        return [i.op for i in self.instrs if i.kind == "run" and i.op.is_collective
                and (stream is None or i.stream == stream)]

    def collective_digest(self) -> str:
        """Hash of each stream's collective sequence: ranks compare it before step 1."""
        text = "\n".join(f"{i.stream} {i.op}" for i in self.instrs
                         if i.kind == "run" and i.op.is_collective)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def render(self, mark: int | None = None) -> str:
        """The plan as text; `mark` points at one instruction (a failure, say)."""
        who = "every rank" if self.rank is None else f"rank {self.rank}"
        n_ops = sum(1 for i in self.instrs if i.kind == "run")
        lines = [f"# plan for {who}: {n_ops} ops on {len(self.streams)} streams "
                 f"({', '.join(self.streams)}), {len(self.producers)} events"]
        for k, ins in enumerate(self.instrs):
            text = f"{k:5d}  {ins}"
            if ins.kind == "record":
                text += f"    # after {self.producers[ins.event]}"
            elif ins.kind == "wait":
                text += f"    # for {self.producers[ins.event]}"
            if k == mark:
                text += "    <-- ERROR HERE"
            lines.append(text)
        return "\n".join(lines)


def lower(sg: ScheduleGraph) -> Plan:
    """The run graph in issue order, with a record/wait pair for every cross-stream edge."""
    g = sg.g
    runs = sg.syncs()
    key: dict[Op, float] = {}
    for s, ops in sg.programs.items():
        prev = -1.0
        for op in ops:
            seq = g.nodes[op].get("seq")
            k = float(seq) if seq is not None else prev + 0.5
            key[op] = k
            prev = k
    indeg = {op: runs.in_degree(op) for op in runs}
    heap = [(key[op], str(op), op) for op, d in indeg.items() if d == 0]
    heapq.heapify(heap)
    order: list[Op] = []
    while heap:
        _, _, op = heapq.heappop(heap)
        order.append(op)
        for nxt in runs.successors(op):
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                heapq.heappush(heap, (key[nxt], str(nxt), nxt))
    if len(order) != len(indeg):
        raise ValueError("the run graph has a cycle; check the schedule first")

    event_of: dict[Op, int] = {}
    consumers: dict[int, list[Op]] = {}
    at = {op: i for i, op in enumerate(order)}
    for u, v in sorted(sg.events(), key=lambda e: (at[e[0]], at[e[1]])):
        if u not in event_of:
            event_of[u] = len(event_of)
        consumers.setdefault(event_of[u], []).append(v)
    waits_for: dict[Op, list[int]] = {}
    for e, vs in consumers.items():
        for v in vs:
            waits_for.setdefault(v, []).append(e)

    instrs: list[Instr] = []
    for op in order:
        stream = g.nodes[op]["stream"]
        for e in sorted(waits_for.get(op, [])):
            instrs.append(Instr("wait", stream, event=e))
        instrs.append(Instr("run", stream, op=op))
        if op in event_of:
            instrs.append(Instr("record", stream, event=event_of[op]))
    streams = tuple(s for s, ops in sg.programs.items() if ops)
    return Plan(sg.rank, streams, tuple(instrs), {e: op for op, e in event_of.items()},
                {e: tuple(vs) for e, vs in consumers.items()})
