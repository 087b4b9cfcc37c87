"""Checked graph -> Plan (schedc/ir/plan.py): instructions in host issue order, with events.

Every cross-stream edge of the graph becomes exactly one `wait`, placed immediately before
its consumer's `run`, for an event recorded immediately after its producer's `run`
(ordering invariant: a record follows its producer and precedes every wait for it).
The issue order is a topological order of the run graph that prefers the canonical
sequence, so a collective is issued the moment its inputs are ready.

A plan with comm streams opens with one more event, the step start: recorded on compute
before anything else and waited for at the head of every comm stream. The step's first
collectives read what the previous step's optimizer (or a resume) wrote on compute, and
allocate memory that compute freed; this edge orders them after it. It is FSDP2's
`_root_pre_forward` (torch/distributed/fsdp/_fully_shard/_fsdp_state.py: "Wait for optimizer
before implicitly prefetched all-gathers", all-gather streams `wait_event` on the post-optim
event or `wait_stream` on the current stream). It is numbered after the ops' events.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

from schedc.ir.effects import required_keeps
from schedc.ir.op import COMPUTE, Op
from schedc.ir.plan import Action, Instr, Plan
from schedc.passes.graph import ScheduleGraph


def lower(sg: ScheduleGraph) -> Plan:
    """The run graph in issue order, with a record/wait pair for every cross-stream edge."""
    order = _issue_order(sg)
    event_of, consumers = _events(sg, order)
    waits_for: dict[Op, list[int]] = {}
    for e, vs in consumers.items():
        for v in vs:
            waits_for.setdefault(v, []).append(e)
    instrs: list[Instr] = []
    streams = tuple(s for s, ops in sg.programs.items() if ops)
    comm_streams = [s for s in streams if s != COMPUTE]
    start = len(event_of) if comm_streams else None
    if start is not None:
        instrs.append(Instr(Action.RECORD, COMPUTE, event=start))
        instrs += [Instr(Action.WAIT, s, event=start) for s in comm_streams]
    for op in order:
        stream = sg.on(op)
        for e in sorted(waits_for.get(op, [])):
            instrs.append(Instr(Action.WAIT, stream, event=e))
        instrs.append(Instr(Action.RUN, stream, op=op))
        if op in event_of:
            instrs.append(Instr(Action.RECORD, stream, event=event_of[op]))
    # what each op reads that another stream allocated, kept alive on its own (ir/effects.py)
    for k, keeps in required_keeps(sg.spec, instrs).items():
        instrs[k] = replace(instrs[k], keeps=keeps)
    return Plan(
        sg.rank,
        streams,
        tuple(instrs),
        {e: op for op, e in event_of.items()},
        {e: tuple(vs) for e, vs in consumers.items()},
        step_start=start,
    )


def _issue_order(sg: ScheduleGraph) -> list[Op]:
    """A topological order of the run graph that prefers the canonical sequence (an op a
    file wrote that the step lacks sorts right after the op before it on its stream)."""
    runs = sg.syncs()
    key: dict[Op, float] = {}
    for ops in sg.programs.values():
        prev = -1.0
        for op in ops:
            seq = sg.node(op).seq
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
    return order


def _events(sg: ScheduleGraph, order: list[Op]) -> tuple[dict[Op, int], dict[int, list[Op]]]:
    """Each producer's event, numbered in issue order, and each event's consumers."""
    event_of: dict[Op, int] = {}
    consumers: dict[int, list[Op]] = {}
    at = {op: i for i, op in enumerate(order)}
    for u, v in sorted(sg.events(), key=lambda e: (at[e[0]], at[e[1]])):
        if u not in event_of:
            event_of[u] = len(event_of)
        consumers.setdefault(event_of[u], []).append(v)
    return event_of, consumers
