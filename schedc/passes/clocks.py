"""Vector clocks over the streams of a schedule graph: which cross-stream waits the generated
programs need, and what is complete before each op starts.

An op's clock says, per stream, the last position on that stream known complete before the
op starts (on its own stream: the op's own position). One walk over the placed ops, producers
first, computes every clock and, at each op of a generated program, chooses its waits: a
need on another stream becomes an event unless the clock already covers it (an earlier
wait implies it), so the plan records and waits as few events as it can. The clocks the
walk leaves are those of the finished run graph; the checker reads them (`ordered`).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from schedc.ir.op import Op
from schedc.passes.payloads import deps, node_of, preds, run_graph

Clock = dict[str, int]  # stream -> the last position known complete


@dataclass(frozen=True)
class Walk:
    """What the walk found: the waits to add, and every placed op's clock once they are in
    (None: the run graph has a cycle, which the checker reports)."""

    events: list[tuple[Op, Op]]
    clock: dict[Op, Clock] | None


def walk(g: nx.DiGraph, programs: dict[str, list[Op]], written: set[str]) -> Walk:
    """Choose the events the generated programs need and compute every placed op's clock.

    Producers come first when the ops are taken in an order of what runs and what will be
    waited for. When written programs contradict a need there is no such order; the ops are
    then taken in the order of what runs alone, a producer may come after its consumer, and
    the clocks are computed again once the events are in (the checker refuses such a
    schedule, but reports it against the finished run graph).
    """
    placed = [op for ops in programs.values() for op in ops]
    order = _producers_first(g, placed)
    if order is None:
        return Walk([], None)
    generated = {op for s, ops in programs.items() if s not in written for op in ops}
    exact = True  # no event from a producer that comes later in `order`
    events: list[tuple[Op, Op]] = []
    clock: dict[Op, Clock] = {}
    streams = list(programs)
    for op in order:
        vc = {s: -1 for s in streams}
        for p, d in preds(g, op):
            if d.sync and p in clock:
                _join(vc, clock[p])
        if op in generated:
            for p in _waits(g, op, vc, clock):
                events.append((p, op))
                exact = exact and p in clock
        me = node_of(g, op)
        vc[_stream(me.stream)] = me.pos
        clock[op] = vc
    return Walk(events, clock if exact else _clocks(g, placed, events))


def _producers_first(g: nx.DiGraph, placed: list[Op]) -> list[Op] | None:
    """The placed ops in an order of what runs and what will be waited for, else of what
    runs alone, else None (the run graph has a cycle)."""
    ahead = nx.DiGraph()
    ahead.add_nodes_from(placed)
    ahead.add_edges_from(
        (u, v) for u, v, d in deps(g) if u in ahead and v in ahead and (d.sync or d.needs)
    )
    try:
        return list(nx.topological_sort(ahead))
    except nx.NetworkXUnfeasible:  # written programs contradict a need: order by what runs
        try:
            return list(nx.topological_sort(run_graph(g, placed)))
        except nx.NetworkXUnfeasible:
            return None


def _waits(g: nx.DiGraph, op: Op, vc: Clock, clock: dict[Op, Clock]) -> list[Op]:
    """The producers on other streams `op` needs that `vc` does not cover, latest first;
    `vc` takes in the clock of each one chosen (a wait covers what its producer follows)."""
    me = node_of(g, op)
    wanted = [
        p for p, d in preds(g, op) if d.needs and node_of(g, p).stream not in (None, me.stream)
    ]
    wanted.sort(key=lambda p: -node_of(g, p).pos)
    chosen = []
    for p in wanted:
        pn = node_of(g, p)
        if vc.get(_stream(pn.stream), -1) >= pn.pos:
            continue  # already ordered by an earlier wait
        chosen.append(p)
        _join(vc, clock.get(p, {}))
    return chosen


def _clocks(g: nx.DiGraph, placed: list[Op], events: list[tuple[Op, Op]]) -> dict[Op, Clock] | None:
    """Every placed op's clock by the run graph with `events` added (None: a cycle)."""
    runs = run_graph(g, placed)
    runs.add_edges_from(events)
    try:
        order = list(nx.topological_sort(runs))
    except nx.NetworkXUnfeasible:
        return None
    clock: dict[Op, Clock] = {}
    for op in order:
        vc: Clock = {}
        for p in runs.predecessors(op):
            _join(vc, clock[p])
        me = node_of(g, op)
        vc[_stream(me.stream)] = me.pos
        clock[op] = vc
    return clock


def _join(vc: Clock, other: Clock) -> None:
    for s, v in other.items():
        vc[s] = max(vc.get(s, -1), v)


def _stream(stream: str | None) -> str:
    if stream is None:
        raise AssertionError("internal: a placed op without a stream")
    return stream


def ordered(g: nx.DiGraph, clock: dict[Op, Clock], u: Op, v: Op) -> bool:
    """Whether u is complete before v starts, by the run graph (u placed, v placed)."""
    nu, nv = node_of(g, u), node_of(g, v)
    if u == v:
        return False
    if nu.stream == nv.stream:
        return nu.pos < nv.pos
    # v's clock counts v itself on its own stream; u on another stream is done before v
    # starts iff some wait of v (or of something before v) reached u's position
    return clock[v].get(_stream(nu.stream), -1) >= nu.pos
