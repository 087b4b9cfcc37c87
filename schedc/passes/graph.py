"""Spec -> the schedule graph: one networkx node per op, edges for what each op needs.

Every node carries an `OpNode` (its stream, its place in the canonical sequence and in its
program, its source line) and every edge a `Dep`, with two kinds of fact in one DiGraph:

* `needs`: why the consumer cannot run before the producer (an activation, a saved
  tensor, gathered parameters, complete gradients, a buffer about to be reused, memory
  that the prefetch window must wait for). These are the facts the checker proves hold.
* `sync`: how the program makes it so: `order` between consecutive ops of one stream,
  `event` for a wait across streams. Only these run.

The generator lays the step out in one canonical sequence (the order a host would issue
it in: fwd, bwd, and each collective the moment its inputs are complete), then projects it
onto streams; every need that crosses streams becomes an event, minus those another
event already implies. A `program` block written in the .sched file replaces the
generated program of its stream and brings exactly the waits it names (`after`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import networkx as nx

from schedc.ir.effects import gather_freed, gathers_read
from schedc.ir.op import STEP, Kind, Op, Phase, bwd, fwd, recompute
from schedc.ir.source import Span
from schedc.ir.spec import DDPSpec, FSDPSpec, ProgramSpec, Spec, Strategy, UnitSpec
from schedc.passes.clocks import Clock, ordered, walk
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


# -- the canonical sequence -----------------------------------------------------------------------


@dataclass
class _Seq:
    """Ops in canonical order, each with its needs and the source line it comes from."""

    ops: list[Op] = field(default_factory=list)
    needs: dict[Op, list[tuple[Op, Need]]] = field(default_factory=lambda: defaultdict(list))
    span: dict[Op, Span | None] = field(default_factory=dict)

    def emit(self, op: Op, needs=(), span: Span | None = None) -> Op:
        self.ops.append(op)
        self.needs[op].extend(needs)
        self.span[op] = span
        return op


def canonical(spec: Spec) -> _Seq:
    """The whole step in the order a host issues it; dispatches on the strategy."""
    if spec.kind is Strategy.FSDP:
        return _fsdp(spec, spec.strategy)
    return _ddp(spec, spec.strategy)


def _compute_needs(spec: Spec, op: Op) -> list[tuple[Op, Need]]:
    layers = spec.model.layers
    i = layers.index(op.target)
    if op.kind is Kind.FWD:
        return [(fwd(layers[i - 1], op.mb), Need.ACT)] if i else []
    if op.kind is Kind.RECOMPUTE:
        return [(fwd(op.target, op.mb), Need.INPUT)]
    maker = recompute if op.target in spec.recompute else fwd
    needs = [(maker(op.target, op.mb), Need.SAVED)]
    if i + 1 < len(layers):
        needs.insert(0, (bwd(layers[i + 1], op.mb), Need.GRAD_IN))
    return needs


def _ddp(spec: Spec, ddp: DDPSpec | None) -> _Seq:
    """fwd all layers, bwd in reverse; each bucket all-reduced once it and all before it fill."""
    seq, cfg = _Seq(), spec.model
    model_span = spec.where.get("model")
    buckets = ddp.buckets if ddp else ()
    bucket_writers = [spec.writers(b.params) for b in buckets]
    bucket_of_layer: dict[str, list[int]] = defaultdict(list)
    for i, ws in enumerate(bucket_writers):
        for w in ws:
            bucket_of_layer[w].append(i)
    for j in range(spec.accum):
        for layer in cfg.layers:
            op = fwd(layer, j)
            seq.emit(op, _compute_needs(spec, op), model_span)
        done: set[str] = set()
        launched = 0
        for layer in reversed(cfg.layers):
            if layer in spec.recompute:  # right before its backward: the shortest lifetime
                again = recompute(layer, j)
                seq.emit(again, _compute_needs(spec, again), _span_of_compute(spec, again))
            op = bwd(layer, j)
            needs = _compute_needs(spec, op)
            if j and spec.communicates(j - 1):
                # this backward writes into buckets the previous all-reduce may still read
                needs += [
                    (Op(Kind.ALLREDUCE, buckets[b].name, j - 1), Need.REUSE)
                    for b in bucket_of_layer[layer]
                ]
            seq.emit(op, needs, model_span)
            done.add(layer)
            if not spec.communicates(j):
                continue
            # launch in the compiled bucket order, never first-ready: every rank must agree
            while launched < len(buckets) and bucket_writers[launched] <= done:
                b = buckets[launched]
                seq.emit(
                    Op(Kind.ALLREDUCE, b.name, j),
                    [(bwd(w, j), Need.GRADS) for w in sorted(bucket_writers[launched])],
                    b.span or spec.where.get("ddp"),
                )
                launched += 1
    last = spec.accum - 1
    if buckets:
        step_needs = [(Op(Kind.ALLREDUCE, b.name, last), Need.UPDATE) for b in buckets]
    else:
        step_needs = [(bwd(layer, last), Need.GRADS) for layer in cfg.layers]
    seq.emit(STEP, step_needs, spec.where.get("optimizer", model_span))
    return seq


@dataclass
class _Use:
    """A run of compute ops (one micro-step, one pass) that needs one unit gathered."""

    unit: UnitSpec
    mb: int
    phase: Phase
    first: int  # index into the compute sequence
    last: int
    gather: bool = False
    free: bool = False
    index: int = -1  # position in the step's list of uses


def _fsdp(spec: Spec, fs: FSDPSpec) -> _Seq:
    """Gather, compute, free per unit; prefetch at the declared depth; reduce-scatter grads."""
    cfg = spec.model
    reads = {layer: [u for u in fs.units if layer in u.layers] for layer in cfg.layers}
    compute = _compute_order(spec)
    uses, prev_of = _unit_uses(fs, compute, reads)
    anchored = _gather_anchors(fs, uses, prev_of)
    ends_at: dict[int, list[int]] = defaultdict(list)
    for m, use in enumerate(uses):
        ends_at[use.last].append(m)
    keep = [u for u in fs.units if u.keep]
    keep_gather = {u.name: Op(Kind.ALLGATHER, u.name, 0, Phase.FWD) for u in keep}
    unit_writers = {u.name: spec.writers(u.params) for u in fs.units}
    rs_after = _reduce_scatter_points(spec, fs, compute, unit_writers)
    readers: dict[Op, list[Op]] = defaultdict(list)  # gather -> its buffer's readers so far

    seq = _Seq()

    def emit_gathers(index: int) -> None:
        for use in anchored.get(index, []):
            m = use.index
            needs = []
            prev = prev_of[m]
            if prev is not None:
                needs.append((_free_op(prev), Need.REUSE))
            depth = fs.prefetch_forward if use.phase is Phase.FWD else fs.prefetch_backward
            if m - depth - 1 >= 0:
                w = uses[m - depth - 1]
                release = _free_op(w) if w.free else compute[w.last]
                if prev is None or release != _free_op(prev):
                    needs.append((release, Need.WINDOW))
            seq.emit(_gather_op(use), needs, use.unit.span)

    for u in keep:
        seq.emit(keep_gather[u.name], [], u.span)
    emit_gathers(-1)
    for i, op in enumerate(compute):
        needs = _compute_needs(spec, op)
        for gather in gathers_read(spec, op):
            needs.append((gather, Need.PARAMS))
            readers[gather].append(op)
        seq.emit(op, needs, _span_of_compute(spec, op))
        for u in rs_after.get(i, []):
            writers = unit_writers[u.name]
            rs_needs = [(bwd(w, op.mb), Need.GRADS) for w in cfg.layers if w in writers]
            if op.mb and not spec.no_sync:
                rs_needs.append((Op(Kind.REDUCESCATTER, u.name, op.mb - 1), Need.REUSE))
            rs = seq.emit(Op(Kind.REDUCESCATTER, u.name, op.mb), rs_needs, u.span)
            if spec.hsdp:
                # HSDP: the shard this rank reduced over its shard group is then averaged
                # over the replicate group (FSDP2's all-reduce after the reduce-scatter)
                seq.emit(Op(Kind.ALLREDUCE, u.name, op.mb), [(rs, Need.GRADS)], u.span)
        for m in ends_at.get(i, []):
            if uses[m].free:
                free = _free_op(uses[m])
                seq.emit(free, _last_uses(spec, free, readers), uses[m].unit.span)
        emit_gathers(i)
    last = spec.accum - 1
    for u in keep:
        free = Op(Kind.FREE, u.name, last, Phase.BWD)
        seq.emit(free, _last_uses(spec, free, readers), u.span)
    final = Kind.ALLREDUCE if spec.hsdp else Kind.REDUCESCATTER  # a unit's last reduction
    seq.emit(
        STEP,
        [(Op(final, u.name, last), Need.UPDATE) for u in fs.units],
        spec.where.get("optimizer", spec.where.get("model")),
    )
    return seq


def _last_uses(spec: Spec, free: Op, readers: dict[Op, list[Op]]) -> list[tuple[Op, Need]]:
    """A free waits for the readers of the buffer it releases in its own micro-step (those
    of earlier micro-steps come before them on the compute stream)."""
    return [(r, Need.LAST_USE) for r in readers[gather_freed(spec, free)] if r.mb == free.mb]


def _span_of_compute(spec: Spec, op: Op) -> Span | None:
    if op.kind is Kind.RECOMPUTE:
        return spec.where.get("recompute") or spec.where.get("fsdp.recompute")
    return spec.where.get("model")


def _compute_order(spec: Spec) -> list[Op]:
    """Every fwd, recompute and bwd of the step, in the order the compute stream runs them."""
    layers = spec.model.layers
    return [
        op
        for j in range(spec.accum)
        for op in [fwd(layer, j) for layer in layers]
        + [
            again
            for layer in reversed(layers)
            for again in (
                [recompute(layer, j), bwd(layer, j)] if layer in spec.recompute else [bwd(layer, j)]
            )
        ]
    ]


def _unit_uses(fs: FSDPSpec, compute: list[Op], reads) -> tuple[list[_Use], dict[int, _Use | None]]:
    """The uses of units not kept gathered, in compute order; which gather and which free,
    and each use's previous use of the same unit."""
    uses: list[_Use] = []
    open_use: dict[str, _Use] = {}
    for i, op in enumerate(compute):
        phase = Phase.FWD if op.kind is Kind.FWD else Phase.BWD
        for u in reads[op.target]:
            if u.keep:
                continue
            cur = open_use.get(u.name)
            if cur and cur.mb == op.mb and cur.phase is phase and cur.last == i - 1:
                cur.last = i
            else:
                open_use[u.name] = _Use(u, op.mb, phase, i, i)
                uses.append(open_use[u.name])
        # the resolve pass proved units contiguous, so each (mb, phase) has one use per unit
    uses.sort(key=lambda x: (x.first, fs.units.index(x.unit)))
    prev_of: dict[int, _Use | None] = {}
    last_seen: dict[str, _Use] = {}
    for m, use in enumerate(uses):
        use.index = m
        prev = last_seen.get(use.unit.name)
        prev_of[m] = prev
        use.gather = prev is None or prev.free
        use.free = use.phase is Phase.BWD or fs.reshard_after_forward
        last_seen[use.unit.name] = use
    return uses, prev_of


def _gather_anchors(fs: FSDPSpec, uses: list[_Use], prev_of) -> dict[int, list[_Use]]:
    """Compute index -> the gathers issued after it: after the release of the use depth+1
    before (the prefetch window) and the previous free of their own buffer, never after
    their own first reader."""
    anchored: dict[int, list[_Use]] = defaultdict(list)
    for m, use in enumerate(uses):
        if not use.gather:
            continue
        depth = fs.prefetch_forward if use.phase is Phase.FWD else fs.prefetch_backward
        anchor = uses[m - depth - 1].last if m - depth - 1 >= 0 else -1
        prev = prev_of[m]
        if prev is not None:
            anchor = max(anchor, prev.last)
        anchored[min(anchor, use.first - 1)].append(use)
    return anchored


def _reduce_scatter_points(
    spec: Spec, fs: FSDPSpec, compute: list[Op], unit_writers
) -> dict[int, list[UnitSpec]]:
    """Compute index -> the reduce-scatters right after it: a unit's, in micro-step j, after
    the last backward of j that writes its gradients (when j communicates)."""
    last_writer: dict[tuple[str, int], int] = {}
    for i, op in enumerate(compute):
        if op.kind is Kind.BWD:
            for u in fs.units:
                if op.target in unit_writers[u.name]:
                    last_writer[(u.name, op.mb)] = i
    by_name = {u.name: u for u in fs.units}
    rs_after: dict[int, list[UnitSpec]] = defaultdict(list)
    for (uname, j), i in last_writer.items():
        if spec.communicates(j):
            rs_after[i].append(by_name[uname])
    return rs_after


def _gather_op(use: _Use) -> Op:
    return Op(Kind.ALLGATHER, use.unit.name, use.mb, use.phase)


def _free_op(use: _Use) -> Op:
    return Op(Kind.FREE, use.unit.name, use.mb, use.phase)


# -- streams, programs and events -----------------------------------------------------------------


def build_graphs(spec: Spec) -> dict[int | None, ScheduleGraph]:
    """One graph for every rank, plus one per rank that has programs of its own."""
    seq = canonical(spec)
    ranks = sorted({p.rank for p in spec.programs if p.rank is not None})
    out = {None: _build(spec, seq, None)}
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


def _build(spec: Spec, seq: _Seq, rank: int | None) -> ScheduleGraph:
    g = nx.DiGraph()
    order = {op: i for i, op in enumerate(seq.ops)}
    for op in seq.ops:
        add_op(g, op, OpNode(seq.span[op], seq=order[op]))
        for producer, why in seq.needs[op]:
            if producer not in g:  # the canonical order lists producers first
                raise AssertionError(f"internal: {op} needs {producer}, which comes later")
            add_dep(g, producer, op).needs.append(why)

    written = _programs_for(spec, rank)
    moved = {ins.op for p in written.values() for ins in p.instrs}
    programs: dict[str, list[Op]] = {s: [] for s in spec.stream_names()}
    for op in seq.ops:
        s = spec.streams[op.kind]
        if s not in written and op not in moved:
            programs.setdefault(s, []).append(op)
    explicit_waits: list[tuple[Op, Op, Span]] = []
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
            node.span = ins.span
            node.stream = s
            for a, a_span in zip(ins.after, ins.after_spans):
                explicit_waits.append((a, ins.op, a_span))
    for s, ops in programs.items():
        for i, op in enumerate(ops):
            node = node_of(g, op)
            node.stream, node.pos = s, i
            if i:
                _sync(g, ops[i - 1], op, Sync.ORDER)
    for a, op, a_span in explicit_waits:
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


def _sync(g: nx.DiGraph, u: Op, v: Op, kind: Sync, span: Span | None = None) -> None:
    d = add_dep(g, u, v)
    if d.sync in (Sync.ORDER, Sync.EVENT) and kind is Sync.AFTER:
        return
    d.sync = kind
    if span is not None:
        d.span = span
