"""The simulator: Compiled -> Timeline, when each op of every rank's plan runs.

Every stream runs its ops in program order, one at a time; an op starts when its stream is
free and every event it waits for has fired; a collective starts when every rank has
reached it. Durations come from the cost model (analysis/cost.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import networkx as nx

from schedc.analysis.cost import CostModel, duration
from schedc.compiler import Compiled
from schedc.ir.op import Kind, Op
from schedc.ir.plan import Action
from schedc.ir.spec import Spec


@dataclass(frozen=True)
class Interval:
    """One op on one rank's stream, from start to end (seconds from the step's start)."""

    rank: int
    stream: str
    op: Op
    start: float
    end: float

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """When each op ran (measured) or would run (predicted), for one step."""

    spec: Spec
    intervals: list[Interval]  # per rank, per stream, in program order
    ranks: tuple[int, ...]
    streams: tuple[str, ...]
    source: str  # "predicted" | "measured"
    every_rank: bool = False  # one rank drawn for all: every rank runs the same plan
    note: str = ""  # the cost model, or the trace and step it was read from

    @property
    def compute_stream(self) -> str:
        return self.spec.streams[Kind.FWD]

    @property
    def end(self) -> float:
        return max((i.end for i in self.intervals), default=0.0)

    def on(self, rank: int, stream: str) -> list[Interval]:
        return [i for i in self.intervals if i.rank == rank and i.stream == stream]

    def find(self, op: Op | str, rank: int | None = None) -> Interval:
        op = Op.parse(op) if isinstance(op, str) else op
        rank = self.ranks[0] if rank is None else rank
        return next(i for i in self.intervals if i.op == op and i.rank == rank)


def simulate(
    compiled: Compiled, cost: CostModel | None = None, ranks: list[int] | None = None
) -> Timeline:
    """Predict one step: the longest path through program order, events and collectives.

    When every rank runs the same plan one rank stands for all (collectives then start as
    soon as that rank reaches them); otherwise every rank is simulated and a collective
    starts when the last rank reaches it.
    """
    spec, cost = compiled.spec, cost or CostModel()
    distinct = any(r is not None for r in compiled.plans)
    sim = list(range(spec.world)) if distinct else [0]
    g = nx.DiGraph()
    runs = {r: _program(g, compiled, r, cost) for r in sim}
    start, end = _times(g)
    shown = (
        [r for r in sim if ranks is None or r in ranks]
        if distinct
        else [(ranks[0] if ranks else 0)]
    )
    intervals = [
        Interval(r, stream, op, start[n], end[n])
        for r in shown
        for stream, op, n in runs[r if distinct else 0]
    ]
    streams = compiled.plan(shown[0] if distinct else None).streams
    return Timeline(
        spec,
        in_stream_order(intervals, streams),
        tuple(shown),
        streams,
        "predicted",
        every_rank=not distinct and spec.world > 1,
        note=cost.describe(spec.numerics),
    )


Node = Hashable  # (rank, op), or ("*", stream, op) for a collective: one node for every rank


def _node(rank: int, stream: str, op: Op) -> Node:
    return ("*", stream, op) if op.is_collective else (rank, op)


def _program(
    g: nx.DiGraph, compiled: Compiled, r: int, cost: CostModel
) -> list[tuple[str, Op, Node]]:
    """Rank `r`'s plan added to `g`: a node per op, its length the op's duration, an edge
    from each op to the next on its stream and from each recorded event's op to the op
    after its wait. The ops it runs, with their streams and nodes, in program order."""
    spec, plan = compiled.spec, compiled.plan(r)
    last: dict[str, Node] = {}
    waits: dict[str, list[Node]] = {}
    runs: list[tuple[str, Op, Node]] = []
    stream_of = {i.op: i.stream for i in plan.instrs if i.kind is Action.RUN}
    for ins in plan.instrs:
        # the step starts at time 0: its start event is nothing to wait for in one step
        if ins.kind is Action.WAIT and ins.event is not None and ins.event != plan.step_start:
            p = plan.producers[ins.event]
            waits.setdefault(ins.stream, []).append(_node(r, stream_of[p], p))
        elif ins.kind is Action.RUN and ins.op is not None:
            n = _node(r, ins.stream, ins.op)
            g.add_node(n, length=duration(spec, ins.op, cost))
            preds = waits.pop(ins.stream, []) + ([last[ins.stream]] if ins.stream in last else [])
            g.add_edges_from((p, n) for p in preds)
            last[ins.stream] = n
            runs.append((ins.stream, ins.op, n))
    return runs


def _times(g: nx.DiGraph) -> tuple[dict[Node, float], dict[Node, float]]:
    """When each node starts and ends: as soon as every predecessor has ended."""
    try:
        order = list(nx.topological_sort(g))
    except nx.NetworkXUnfeasible:
        raise ValueError(
            "the ranks issue their collectives in different orders: the "
            "schedule would hang (schedc check reports where)"
        ) from None
    end: dict[Node, float] = {}
    start: dict[Node, float] = {}
    for n in order:
        start[n] = max((end[p] for p in g.predecessors(n)), default=0.0)
        end[n] = start[n] + g.nodes[n]["length"]
    return start, end


def in_stream_order(intervals: list[Interval], streams) -> list[Interval]:
    rank_of = {s: i for i, s in enumerate(streams)}
    return sorted(intervals, key=lambda i: (i.rank, rank_of.get(i.stream, 99), i.start, i.end))
