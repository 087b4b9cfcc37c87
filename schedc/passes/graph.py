"""Spec -> the schedule graph: one networkx node per op, edges for what each op needs.

Every node carries an `OpNode` (its stream, its place in the canonical sequence and in its
program, its source line) and every edge a `Dep` (passes/payloads.py), with two kinds of
fact in one DiGraph:

* `needs`: why the consumer cannot run before the producer (an activation, a saved
  tensor, gathered parameters, complete gradients, a buffer about to be reused, memory
  that the prefetch window must wait for). These are the facts the checker proves hold.
* `sync`: how the program makes it so: `order` between consecutive ops of one stream,
  `event` for a wait across streams. Only these run.

The generator lays the step out in one canonical sequence (the order a host would issue
it in: fwd, bwd, and each collective the moment its inputs are complete; passes/ddp.py,
passes/fsdp.py), then projects it onto streams; every need that crosses streams becomes an
event, minus those another event already implies (passes/clocks.py). A `program` block
written in the .sched file replaces the generated program of its stream and brings exactly
the waits it names (`after`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import networkx as nx

from schedc.ir.op import Op
from schedc.ir.source import Span
from schedc.ir.spec import ProgramSpec, Spec, Strategy
from schedc.passes.clocks import Clock, ordered, walk
from schedc.passes.ddp import ddp_sequence
from schedc.passes.fsdp import fsdp_sequence
from schedc.passes.payloads import (
    Dep,
    Need,
    OpNode,
    Sync,
    add_dep,
    add_op,
    dep_of,
    deps,
    node_of,
    preds,
    run_graph,
)
from schedc.passes.sequence import OpSequence


@dataclass
class ScheduleGraph:
    """The ops of one step on one rank (or on every rank, when `rank` is None)."""

    spec: Spec
    rank: int | None
    g: nx.DiGraph  # Op nodes with an OpNode, edges with a Dep (passes/payloads.py)
    programs: dict[str, list[Op]]  # stream -> ops in program order
    written: set[str] = field(default_factory=set)  # streams whose program the file wrote
    # every placed op's vector clock (passes/clocks.py); None: the run graph has a cycle
    clock: dict[Op, Clock] | None = None

    def node(self, op: Op) -> OpNode:
        return node_of(self.g, op)

    def dep(self, u: Op, v: Op) -> Dep:
        return dep_of(self.g, u, v)

    def deps(self) -> Iterator[tuple[Op, Op, Dep]]:
        return deps(self.g)

    def preds(self, op: Op) -> Iterator[tuple[Op, Dep]]:
        return preds(self.g, op)

    def stream_of(self, op: Op) -> str | None:
        return self.node(op).stream

    def on(self, op: Op) -> str:
        """The stream a placed op runs on."""
        stream = self.node(op).stream
        if stream is None:
            raise AssertionError(f"internal: {op} is on no stream")
        return stream

    def placed(self) -> list[Op]:
        return [op for ops in self.programs.values() for op in ops]

    def needs(self) -> Iterator[tuple[Op, Op, list[Need]]]:
        """(producer, consumer, reasons) for every need."""
        for u, v, d in self.deps():
            if d.needs:
                yield u, v, d.needs

    def syncs(self) -> nx.DiGraph:
        """The graph that runs: program order and events, placed ops only."""
        return run_graph(self.g, self.placed())

    def events(self) -> list[tuple[Op, Op]]:
        return [(u, v) for u, v, d in self.deps() if d.sync is Sync.EVENT]

    def span_of(self, op: Op) -> Span | None:
        return self.node(op).span if op in self.g else None

    def ordered(self, u: Op, v: Op) -> bool:
        """Whether u is complete before v starts, by the run graph (both placed; no cycle)."""
        if self.clock is None:
            raise AssertionError("internal: the run graph has a cycle; nothing is ordered")
        return ordered(self.g, self.clock, u, v)


def canonical(spec: Spec) -> OpSequence:
    """The whole step in the order a host issues it (passes/sequence.py), by strategy."""
    if spec.kind is Strategy.FSDP:
        return fsdp_sequence(spec)
    return ddp_sequence(spec)


# -- streams, programs and events -----------------------------------------------------------------


def build_graphs(spec: Spec) -> dict[int | None, ScheduleGraph]:
    """One graph for every rank, plus one per rank that has programs of its own."""
    seq = canonical(spec)
    ranks = sorted({p.rank for p in spec.programs if p.rank is not None})
    out: dict[int | None, ScheduleGraph] = {None: _build(spec, seq, None)}
    for r in ranks:
        out[r] = _build(spec, seq, r)
    return out


def _programs_for(spec: Spec, rank: int | None) -> dict[str, ProgramSpec]:
    chosen: dict[str, ProgramSpec] = {}
    for p in spec.programs:
        if p.rank is None and p.stream not in chosen:
            chosen[p.stream] = p
    for p in spec.programs:
        if rank is not None and p.rank == rank:
            chosen[p.stream] = p
    return chosen


def _build(spec: Spec, seq: OpSequence, rank: int | None) -> ScheduleGraph:
    g = _needs_graph(seq)
    written = _programs_for(spec, rank)
    moved = {ins.op for p in written.values() for ins in p.instrs}
    programs: dict[str, list[Op]] = {s: [] for s in spec.stream_names()}
    for op in seq.ops:
        s = spec.streams[op.kind]
        if s not in written and op not in moved:
            programs.setdefault(s, []).append(op)
    waits = _place_written(g, written, programs)
    for s, ops in programs.items():
        for i, op in enumerate(ops):
            node = node_of(g, op)
            node.stream, node.pos = s, i
            if i:
                _sync(g, ops[i - 1], op, Sync.ORDER)
    for a, op, a_span in waits:
        if a not in g:
            add_op(g, a, OpNode(a_span))
        if node_of(g, a).stream == node_of(g, op).stream:
            _sync(g, a, op, Sync.AFTER, a_span)  # same-stream wait: order, or a deadlock if later
        else:
            _sync(g, a, op, Sync.EVENT, a_span)
    found = walk(g, programs, set(written))
    for producer, consumer in found.events:
        _sync(g, producer, consumer, Sync.EVENT)
    return ScheduleGraph(spec, rank, g, programs, set(written), found.clock)


def _needs_graph(seq: OpSequence) -> nx.DiGraph:
    """Every op of the canonical sequence, with its needs; nothing placed yet."""
    g = nx.DiGraph()
    for i, op in enumerate(seq.ops):
        add_op(g, op, OpNode(seq.span[op], seq=i))
        for producer, why in seq.needs[op]:
            if producer not in g:  # the canonical order lists producers first
                raise AssertionError(f"internal: {op} needs {producer}, which comes later")
            add_dep(g, producer, op).needs.append(why)
    return g


def _place_written(
    g: nx.DiGraph, written: dict[str, ProgramSpec], programs: dict[str, list[Op]]
) -> list[tuple[Op, Op, Span]]:
    """The written programs into `programs` (an op the step lacks joins the graph, to be
    reported); the waits they name, as (producer, consumer, the `after`'s span)."""
    waits: list[tuple[Op, Op, Span]] = []
    for s, prog in written.items():
        programs[s] = []
        for ins in prog.instrs:
            if ins.op not in g:
                add_op(g, ins.op, OpNode(ins.span))
            node = node_of(g, ins.op)
            if node.stream is not None:
                node.again = ins.span  # written twice; the checker reports it
                continue
            programs[s].append(ins.op)
            node.span, node.stream = ins.span, s
            waits += [(a, ins.op, a_span) for a, a_span in zip(ins.after, ins.after_spans)]
    return waits


def _sync(g: nx.DiGraph, u: Op, v: Op, kind: Sync, span: Span | None = None) -> None:
    d = add_dep(g, u, v)
    if d.sync in (Sync.ORDER, Sync.EVENT) and kind is Sync.AFTER:
        return
    d.sync = kind
    if span is not None:
        d.span = span
