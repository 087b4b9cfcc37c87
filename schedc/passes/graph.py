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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum

import networkx as nx

from schedc.ir.op import STEP, Kind, Op, Phase, bwd, fwd, recompute
from schedc.ir.source import Span
from schedc.ir.spec import DDPSpec, FSDPSpec, ProgramSpec, Spec, Strategy, UnitSpec


class Need(str, Enum):
    """Why a consumer needs its producer (a `Dep`'s reasons; the text names it in messages)."""

    ACT = "activation"  # fwd[L] reads fwd[L-1]'s output
    GRAD_IN = "output gradient"  # bwd[L] reads the gradient bwd[L+1] produced
    SAVED = "saved activations"  # bwd[L] reads what fwd[L] (or recompute[L]) saved
    INPUT = "kept input"  # recompute[L] reruns forward from the input fwd[L] kept
    PARAMS = "gathered parameters"  # compute reads a unit's full parameters
    GRADS = "complete gradients"  # a reduction reads gradients its writers produced
    REUSE = "buffer reuse"  # a write into a buffer a collective is still reading
    LAST_USE = "last use"  # a free releases parameters only after their last reader
    WINDOW = "prefetch window"  # a gather waits for memory to come free
    UPDATE = "reduced gradients"  # the optimizer reads every reduction


def said(needs: Iterable[Need]) -> str:
    """Reasons in words, as messages and pictures name them: "activation, buffer reuse"."""
    return ", ".join(n.value for n in needs)


class Sync(str, Enum):
    """How a program makes a consumer wait for its producer (a `Dep` that runs)."""

    ORDER = "order"  # consecutive ops of one stream
    AFTER = "after"  # a written `after` on the producer's own stream
    EVENT = "event"  # a wait across streams: a recorded event


@dataclass
class OpNode:
    """What the graph knows of one op."""

    span: Span | None  # where the file says it: its program line, else the declaration
    seq: int | None = None  # its place in the canonical sequence; None: only the file names it
    stream: str | None = None  # None: no program holds it
    pos: int = -1  # its place in its stream's program (placed ops)
    again: Span | None = None  # a second line that writes it (the checker reports it)

    @property
    def required(self) -> bool:
        """Whether the step needs it (the canonical sequence has it)."""
        return self.seq is not None

    @property
    def placed(self) -> bool:
        return self.stream is not None


@dataclass
class Dep:
    """What one edge says: why the consumer needs the producer, and how it waits, if it does."""

    needs: list[Need] = field(default_factory=list)
    sync: Sync | None = None
    span: Span | None = None  # the written `after` that makes the wait, if one does


# the one attribute each node and edge of the networkx graph carries
_NODE, _DEP = "node", "dep"


def node_of(g: nx.DiGraph, op: Op) -> OpNode:
    node: OpNode = g.nodes[op][_NODE]
    return node


def dep_of(g: nx.DiGraph, u: Op, v: Op) -> Dep:
    """The edge u -> v's payload (the edge is made, empty, if it is not there)."""
    if not g.has_edge(u, v):
        g.add_edge(u, v, **{_DEP: Dep()})
    dep: Dep = g.edges[u, v][_DEP]
    return dep


@dataclass
class ScheduleGraph:
    """The ops of one step on one rank (or on every rank, when `rank` is None)."""

    spec: Spec
    rank: int | None
    g: nx.DiGraph  # nodes Op with an OpNode, edges with a Dep (`node`, `dep`, `deps`)
    programs: dict[str, list[Op]]  # stream -> ops in program order
    written: set[str] = field(default_factory=set)  # streams whose program the file wrote

    def node(self, op: Op) -> OpNode:
        return node_of(self.g, op)

    def dep(self, u: Op, v: Op) -> Dep:
        dep: Dep = self.g.edges[u, v][_DEP]
        return dep

    def deps(self) -> Iterator[tuple[Op, Op, Dep]]:
        """Every edge with its payload, in the graph's order."""
        yield from self.g.edges(data=_DEP)

    def preds(self, op: Op) -> Iterator[tuple[Op, Dep]]:
        """The producers of `op`'s edges, with their payloads, in the graph's order."""
        for p in self.g.predecessors(op):
            yield p, self.dep(p, op)

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
        h = nx.DiGraph()
        h.add_nodes_from(self.placed())
        # an `after` may name an op no program holds; nothing runs it (the checker says so)
        h.add_edges_from((u, v) for u, v, d in self.deps() if d.sync and u in h and v in h)
        return h

    def events(self) -> list[tuple[Op, Op]]:
        return [(u, v) for u, v, d in self.deps() if d.sync is Sync.EVENT]

    def span_of(self, op: Op) -> Span | None:
        return self.node(op).span if op in self.g else None


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
    source_gather = _source_gathers(uses, prev_of)
    use_at = {
        (use.unit.name, i): m for m, use in enumerate(uses) for i in range(use.first, use.last + 1)
    }  # (unit, compute index) -> use
    ends_at: dict[int, list[int]] = defaultdict(list)
    for m, use in enumerate(uses):
        ends_at[use.last].append(m)
    keep = [u for u in fs.units if u.keep]
    keep_gather = {u.name: Op(Kind.ALLGATHER, u.name, 0, Phase.FWD) for u in keep}
    unit_writers = {u.name: spec.writers(u.params) for u in fs.units}
    rs_after = _reduce_scatter_points(spec, fs, compute, unit_writers)
    readers = _readers_since_gather(compute, uses, prev_of)

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
        for u in reads[op.target]:
            if u.keep:
                needs.append((keep_gather[u.name], Need.PARAMS))
            else:
                needs.append((source_gather[use_at[(u.name, i)]], Need.PARAMS))
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
                seq.emit(
                    _free_op(uses[m]), [(r, Need.LAST_USE) for r in readers[m]], uses[m].unit.span
                )
        emit_gathers(i)
    last = spec.accum - 1
    for u in keep:
        final_readers = [c for c in compute if c.mb == last and c.target in u.layers]
        seq.emit(
            Op(Kind.FREE, u.name, last, Phase.BWD),
            [(r, Need.LAST_USE) for r in final_readers],
            u.span,
        )
    final = Kind.ALLREDUCE if spec.hsdp else Kind.REDUCESCATTER  # a unit's last reduction
    seq.emit(
        STEP,
        [(Op(final, u.name, last), Need.UPDATE) for u in fs.units],
        spec.where.get("optimizer", spec.where.get("model")),
    )
    return seq


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


def _source_gathers(uses: list[_Use], prev_of) -> dict[int, Op]:
    """The live gather of each use (a bwd use without a gather reads the fwd use's buffer)."""
    source: dict[int, Op] = {}
    for m, use in enumerate(uses):
        source[m] = _gather_op(use) if use.gather else source[prev_of[m].index]
    return source


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


def _readers_since_gather(compute: list[Op], uses: list[_Use], prev_of) -> dict[int, list[Op]]:
    """For each use, the compute ops that read its buffer since it was gathered (a free
    waits for all of them)."""
    readers = {m: compute[u.first : u.last + 1] for m, u in enumerate(uses)}
    for m, use in enumerate(uses):
        if use.free and not use.gather:
            readers[m] = readers[prev_of[m].index] + readers[m]
    return readers


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
        g.add_node(op, **{_NODE: OpNode(seq.span[op], seq=order[op])})
        for producer, why in seq.needs[op]:
            if producer not in g:  # the canonical order lists producers first
                raise AssertionError(f"internal: {op} needs {producer}, which comes later")
            dep_of(g, producer, op).needs.append(why)

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
                g.add_node(ins.op, **{_NODE: OpNode(ins.span)})
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
            g.add_node(a, **{_NODE: OpNode(a_span)})
        if node_of(g, a).stream == node_of(g, op).stream:
            _sync(g, a, op, Sync.AFTER, a_span)  # same-stream wait: order, or a deadlock if later
        else:
            _sync(g, a, op, Sync.EVENT, a_span)
    sg = ScheduleGraph(spec, rank, g, {s: ops for s, ops in programs.items()}, set(written))
    for producer, consumer in _needed_events(sg):
        _sync(g, producer, consumer, Sync.EVENT)
    return sg


def _sync(g: nx.DiGraph, u: Op, v: Op, kind: Sync, span: Span | None = None) -> None:
    d = dep_of(g, u, v)
    if d.sync in (Sync.ORDER, Sync.EVENT) and kind is Sync.AFTER:
        return
    d.sync = kind
    if span is not None:
        d.span = span


def _needed_events(sg: ScheduleGraph) -> list[tuple[Op, Op]]:
    """The cross-stream waits every generated op's needs call for, and no more.

    A wait is skipped when an earlier wait on the same stream already covers it (vector
    clocks over the streams), so the plan records and waits as few events as it can.
    """
    streams = list(sg.programs)
    # order by what runs and by what will be waited for, so producers come first
    placed = set(sg.placed())
    ahead = nx.DiGraph()
    ahead.add_nodes_from(placed)
    ahead.add_edges_from(
        (u, v) for u, v, d in sg.deps() if u in placed and v in placed and (d.sync or d.needs)
    )
    try:
        topo = list(nx.topological_sort(ahead))
    except nx.NetworkXUnfeasible:  # written programs contradict a need: order by what runs
        try:
            topo = list(nx.topological_sort(sg.syncs()))
        except nx.NetworkXUnfeasible:
            return []  # the checker reports the cycle
    events: list[tuple[Op, Op]] = []
    generated = {op for s, ops in sg.programs.items() if s not in sg.written for op in ops}
    clock: dict[Op, dict[str, int]] = {}
    for op in topo:
        vc = {s: -1 for s in streams}
        for p, d in sg.preds(op):
            if d.sync and p in clock:
                for s, v in clock[p].items():
                    vc[s] = max(vc[s], v)
        me = sg.node(op)
        if op in generated:
            wanted = [
                p for p, d in sg.preds(op) if d.needs and sg.node(p).stream not in (None, me.stream)
            ]
            wanted.sort(key=lambda p: -sg.node(p).pos)
            for p in wanted:
                pn = sg.node(p)
                if vc[pn.stream] >= pn.pos:
                    continue  # already ordered by an earlier wait
                events.append((p, op))
                for s, v in clock.get(p, {}).items():
                    vc[s] = max(vc[s], v)
        vc[me.stream] = me.pos
        clock[op] = vc
    return events


def happens_before(sg: ScheduleGraph) -> dict[Op, dict[str, int]] | None:
    """Vector clock of every placed op: per stream, the last position known done before it
    starts (its own stream: its own position). None when the run graph has a cycle."""
    runs = sg.syncs()
    try:
        topo = list(nx.topological_sort(runs))
    except nx.NetworkXUnfeasible:
        return None
    clock: dict[Op, dict[str, int]] = {}
    for op in topo:
        vc: dict[str, int] = defaultdict(lambda: -1)
        for p in runs.predecessors(op):
            for s, v in clock[p].items():
                vc[s] = max(vc[s], v)
        me = sg.node(op)
        vc[me.stream] = me.pos
        clock[op] = vc
    return clock


def ordered(sg: ScheduleGraph, clock, u: Op, v: Op) -> bool:
    """Whether u is complete before v starts, by the run graph (u placed, v placed)."""
    nu, nv = sg.node(u), sg.node(v)
    if u == v:
        return False
    if nu.stream == nv.stream:
        return nu.pos < nv.pos
    # v's clock counts v itself on its own stream; u on another stream is done before v
    # starts iff some wait of v (or of something before v) reached u's position
    return clock[v].get(nu.stream, -1) >= nu.pos
