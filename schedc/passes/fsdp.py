"""FSDP's step as a canonical sequence: gather, compute, free per unit; prefetch at the
declared depth; each unit's gradients reduce-scattered after their last writer (and, under
HSDP, all-reduced over the replicate dimension).

A unit's *use* is a run of compute ops of one micro-step and one pass that read it; each use
reads the buffer of one all-gather and is released by one free, as ir/effects.py says
(`gather_of`, `gathers_read`, `gather_freed`); here is where those ops go in the sequence.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from schedc.ir.effects import gather_freed, gather_of, gathers_read
from schedc.ir.op import STEP, Kind, Op, Phase, bwd
from schedc.ir.spec import FSDPSpec, Spec, UnitSpec
from schedc.passes.payloads import Need
from schedc.passes.sequence import OpSequence, compute_needs, compute_order, span_of_compute


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
    prev: _Use | None = None  # the unit's use before this one

    @property
    def gather_op(self) -> Op:
        return Op(Kind.ALLGATHER, self.unit.name, self.mb, self.phase)

    @property
    def free_op(self) -> Op:
        return Op(Kind.FREE, self.unit.name, self.mb, self.phase)


def fsdp_sequence(spec: Spec) -> OpSequence:
    return _FsdpStep(spec).run()


class _FsdpStep:
    """The tables the sequence is laid out from, and the walk that lays it out."""

    def __init__(self, spec: Spec):
        self.spec, fs = spec, spec.fsdp
        self.fs = fs
        self.compute = compute_order(spec)
        self.uses = _unit_uses(spec, self.compute)
        self.anchored = _gather_anchors(fs, self.uses)
        self.ends_at: dict[int, list[_Use]] = defaultdict(list)  # compute index -> uses ending
        for use in self.uses:
            self.ends_at[use.last].append(use)
        self.keep = [u for u in fs.units if u.keep]
        self.writers = {u.name: spec.writers(u.params) for u in fs.units}  # unit -> layers
        self.rs_after = _reduce_scatter_points(spec, self.compute, self.writers)
        self.readers: dict[Op, list[Op]] = defaultdict(list)  # gather -> its readers so far
        self.seq = OpSequence()

    def run(self) -> OpSequence:
        spec, seq = self.spec, self.seq
        for u in self.keep:
            seq.emit(gather_of(spec, u, 0, Phase.FWD), [], u.span)
        self.gathers(-1)
        for i, op in enumerate(self.compute):
            needs = compute_needs(spec, op)
            for gather in gathers_read(spec, op):
                needs.append((gather, Need.PARAMS))
                self.readers[gather].append(op)
            seq.emit(op, needs, span_of_compute(spec, op))
            for u in self.rs_after.get(i, []):
                self.reduce(u, op.mb)
            for use in self.ends_at.get(i, []):
                if use.free:
                    seq.emit(use.free_op, self.last_uses(use.free_op), use.unit.span)
            self.gathers(i)
        last = spec.accum - 1
        for u in self.keep:
            free = Op(Kind.FREE, u.name, last, Phase.BWD)
            seq.emit(free, self.last_uses(free), u.span)
        final = Kind.ALLREDUCE if spec.hsdp else Kind.REDUCESCATTER  # a unit's last reduction
        seq.emit(
            STEP,
            [(Op(final, u.name, last), Need.UPDATE) for u in self.fs.units],
            spec.where.get("optimizer", spec.where.get("model")),
        )
        return seq

    def gathers(self, index: int) -> None:
        """The gathers issued right after compute op `index` (-1: before the first)."""
        fs, uses = self.fs, self.uses
        for use in self.anchored.get(index, []):
            needs = []
            prev = use.prev
            if prev is not None:
                needs.append((prev.free_op, Need.REUSE))
            depth = fs.prefetch_forward if use.phase is Phase.FWD else fs.prefetch_backward
            if use.index - depth - 1 >= 0:
                w = uses[use.index - depth - 1]
                release = w.free_op if w.free else self.compute[w.last]
                if prev is None or release != prev.free_op:
                    needs.append((release, Need.WINDOW))
            self.seq.emit(use.gather_op, needs, use.unit.span)

    def reduce(self, u: UnitSpec, mb: int) -> None:
        """Unit u's reduce-scatter of micro-step mb (and HSDP's all-reduce after it)."""
        spec = self.spec
        writers = self.writers[u.name]
        needs = [(bwd(w, mb), Need.GRADS) for w in spec.model.layers if w in writers]
        if mb and not spec.no_sync:
            needs.append((Op(Kind.REDUCESCATTER, u.name, mb - 1), Need.REUSE))
        rs = self.seq.emit(Op(Kind.REDUCESCATTER, u.name, mb), needs, u.span)
        if spec.hsdp:
            # HSDP: the shard this rank reduced over its shard group is then averaged
            # over the replicate group (FSDP2's all-reduce after the reduce-scatter)
            self.seq.emit(Op(Kind.ALLREDUCE, u.name, mb), [(rs, Need.GRADS)], u.span)

    def last_uses(self, free: Op) -> list[tuple[Op, Need]]:
        """A free waits for the readers of the buffer it releases in its own micro-step
        (those of earlier micro-steps come before them on the compute stream)."""
        readers = self.readers[gather_freed(self.spec, free)]
        return [(r, Need.LAST_USE) for r in readers if r.mb == free.mb]


def _unit_uses(spec: Spec, compute: list[Op]) -> list[_Use]:
    """The uses of units not kept gathered, in compute order, each with its previous use of
    the same unit, and whether it gathers (ir/effects.py: whether its buffer is its own
    gather's) and frees."""
    fs = spec.fsdp
    reads = {layer: [u for u in fs.units if layer in u.layers] for layer in spec.model.layers}
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
    last_seen: dict[str, _Use] = {}
    for m, use in enumerate(uses):
        use.index, use.prev = m, last_seen.get(use.unit.name)
        use.gather = gather_of(spec, use.unit, use.mb, use.phase) == use.gather_op
        use.free = use.phase is Phase.BWD or fs.reshard_after_forward
        last_seen[use.unit.name] = use
    return uses


def _gather_anchors(fs: FSDPSpec, uses: list[_Use]) -> dict[int, list[_Use]]:
    """Compute index -> the gathers issued after it: after the release of the use depth+1
    before (the prefetch window) and the previous free of their own buffer, never after
    their own first reader."""
    anchored: dict[int, list[_Use]] = defaultdict(list)
    for m, use in enumerate(uses):
        if not use.gather:
            continue
        depth = fs.prefetch_forward if use.phase is Phase.FWD else fs.prefetch_backward
        anchor = uses[m - depth - 1].last if m - depth - 1 >= 0 else -1
        if use.prev is not None:
            anchor = max(anchor, use.prev.last)
        anchored[min(anchor, use.first - 1)].append(use)
    return anchored


def _reduce_scatter_points(
    spec: Spec, compute: list[Op], writers: dict[str, frozenset[str]]
) -> dict[int, list[UnitSpec]]:
    """Compute index -> the reduce-scatters right after it: a unit's, in micro-step j, after
    the last backward of j that writes its gradients (when j communicates)."""
    units = spec.fsdp.units
    last_writer: dict[tuple[str, int], int] = {}
    for i, op in enumerate(compute):
        if op.kind is Kind.BWD:
            for u in units:
                if op.target in writers[u.name]:
                    last_writer[(u.name, op.mb)] = i
    by_name = {u.name: u for u in units}
    rs_after: dict[int, list[UnitSpec]] = defaultdict(list)
    for (uname, j), i in last_writer.items():
        if spec.communicates(j):
            rs_after[i].append(by_name[uname])
    return rs_after
