"""Adjacent compute ops that nothing in the plan separates run as one call.

The plan orders ops per layer, but when `fwd[h.0]@mb0, fwd[h.1]@mb0, fwd[h.2]@mb0` follow
each other with no record, wait, collective or free between them, running them one by
one only adds Python and autograd overhead: the result and every ordering the plan
promises are the same if the executor runs them as one forward over h.0 .. h.2, and the
matching backward as one autograd.backward call.

The executor must still cut the model wherever either pass is split: a backward segment
stops at a leaf (a detached layer input), so every place where a forward segment begins
or a backward segment ends becomes a cut in both passes of that micro-step. Fusion is
off when tracing, so a trace shows every op on its own.

One cut is made for speed: a layer that reads a parameter an earlier layer also read (the
head, through the tied wte) starts a segment of its own. Inside one autograd.backward the
two gradients of wte would be summed out of place (a fresh vocab x n_embd tensor every
micro-step) before being added to .grad; in two calls each is added to .grad in place.
On the 30M-parameter model at world 1 that sum was 11% of the step, and fusing without
this cut ran slower than not fusing at all (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from schedc.ir.op import COMPUTE, Kind, Op
from schedc.ir.plan import Action, Instr, Plan
from schedc.model.arch import GPTConfig


@dataclass(frozen=True)
class Segment:
    """Compute ops of one micro-step and pass, run as one call."""

    kind: Kind  # FWD or BWD
    mb: int
    layers: tuple[str, ...]  # in the pass's order: ascending for FWD, descending for BWD
    first: int  # index in plan.instrs of the first op (for failure reports)

    @property
    def ops(self) -> tuple[Op, ...]:
        return tuple(Op(self.kind, layer, self.mb) for layer in self.layers)


Item = int | Segment  # an instruction index, or a run of fused compute instructions


def fuse(plan: Plan, model: GPTConfig, enabled: bool = True) -> list[Item]:
    """The plan as items to execute, with fusable compute runs grouped into Segments."""
    index = {layer: i for i, layer in enumerate(model.layers)}
    runs = _runs(plan, index, enabled)
    cuts = _cuts(plan, model, index, runs)
    items: list[Item] = []
    for run in runs:
        op = _compute_op(plan.instrs[run[0]])
        if op is None:
            items.append(run[0])
        else:
            items += _pieces(plan, run, op.kind, cuts[op.mb], index)
    return items


def _compute_op(ins: Instr) -> Op | None:
    """The op of a forward or backward on the compute stream (what may fuse), else None."""
    op = ins.op
    if ins.kind is Action.RUN and ins.stream == COMPUTE and op is not None:
        return op if op.kind in (Kind.FWD, Kind.BWD) else None
    return None


def _runs(plan: Plan, index: dict[str, int], enabled: bool) -> list[list[int]]:
    """The plan's instruction indexes in runs that may fuse: forwards (or backwards) of one
    micro-step over adjacent layers in the pass's order, with nothing between them."""
    # a recomputing layer's forward runs alone (without autograd), as does the recompute
    alone = {(op.target, op.mb) for op in plan.ops if op.kind is Kind.RECOMPUTE}
    runs: list[list[int]] = []
    prev: Op | None = None  # the compute op ending the last run, if it ends with one
    for k, ins in enumerate(plan.instrs):
        op = _compute_op(ins)
        if enabled and op is not None and prev is not None and _follows(op, prev, index, alone):
            runs[-1].append(k)
        else:
            runs.append([k])
        prev = op
    return runs


def _follows(op: Op, prev: Op, index: dict[str, int], alone: set[tuple[str, int]]) -> bool:
    """`op` continues the run `prev` ends: the same pass and micro-step, the next layer in
    the pass's order, neither a recomputing layer's forward."""
    step = 1 if op.kind is Kind.FWD else -1
    return (
        prev.kind is op.kind
        and prev.mb == op.mb
        and index[op.target] == index[prev.target] + step
        and not (op.kind is Kind.FWD and {(op.target, op.mb), (prev.target, prev.mb)} & alone)
    )


def _cuts(
    plan: Plan, model: GPTConfig, index: dict[str, int], runs: list[list[int]]
) -> dict[int, set[int]]:
    """Per micro-step, the layers both passes are split at: the input of the first layer of
    every forward run and of the last layer of every backward run, and every layer that
    re-reads a parameter (model.rereaders)."""
    cuts: dict[int, set[int]] = {
        op.mb: {index[layer] for layer in model.rereaders()}
        for op in plan.ops
        if op.kind in (Kind.FWD, Kind.BWD)
    }
    for run in runs:
        op = _compute_op(plan.instrs[run[0]])
        if op is not None:
            low = _op(plan, run[0 if op.kind is Kind.FWD else -1])
            cuts.setdefault(op.mb, set()).add(index[low.target])
    return cuts


def _pieces(
    plan: Plan, run: list[int], kind: Kind, cut: set[int], index: dict[str, int]
) -> list[Segment]:
    """A run split at the cuts: a forward piece ends before a cut, a backward piece at one."""
    pieces: list[Segment] = []
    piece: list[int] = []
    for k, op in ((k, _op(plan, k)) for k in run):
        i = index[op.target]
        if piece and kind is Kind.FWD and i in cut:
            pieces.append(_segment(plan, piece))
            piece = []
        piece.append(k)
        if kind is Kind.BWD and i in cut:
            pieces.append(_segment(plan, piece))
            piece = []
    if piece:
        pieces.append(_segment(plan, piece))
    return pieces


def _op(plan: Plan, k: int) -> Op:
    op = plan.instrs[k].op
    assert op is not None, "a run's instructions are ops"
    return op


def _segment(plan: Plan, ks: list[int]) -> Segment:
    ops = [_op(plan, k) for k in ks]
    return Segment(ops[0].kind, ops[0].mb, tuple(op.target for op in ops), ks[0])
