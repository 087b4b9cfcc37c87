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
from schedc.ir.plan import Action, Plan
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
    # a recomputing layer's forward runs alone (without autograd), as does the recompute
    alone = {(op.target, op.mb) for op in plan.ops if op.kind is Kind.RECOMPUTE}
    runs: list[list[int]] = []  # runs of instruction indexes that may fuse
    for k, ins in enumerate(plan.instrs):
        op = ins.op
        if (
            ins.kind is not Action.RUN
            or ins.stream != COMPUTE
            or op.kind not in (Kind.FWD, Kind.BWD)
        ):
            runs.append([k])
            continue
        prev = plan.instrs[runs[-1][-1]].op if runs else None
        step = 1 if op.kind is Kind.FWD else -1
        if (
            enabled
            and prev is not None
            and plan.instrs[runs[-1][-1]].kind is Action.RUN
            and prev.kind is op.kind
            and prev.mb == op.mb
            and prev.kind in (Kind.FWD, Kind.BWD)
            and plan.instrs[runs[-1][-1]].stream == COMPUTE
            and index[op.target] == index[prev.target] + step
            and not (op.kind is Kind.FWD and {(op.target, op.mb), (prev.target, prev.mb)} & alone)
        ):
            runs[-1].append(k)
        else:
            runs.append([k])

    # cuts: the input of the first layer of every forward run and of the last layer of every
    # backward run, per micro-step; both passes are split at all of them
    cuts: dict[int, set[int]] = {
        op.mb: {index[layer] for layer in model.rereaders()}
        for op in plan.ops
        if op.kind in (Kind.FWD, Kind.BWD)
    }
    for run in runs:
        op = plan.instrs[run[0]].op
        if op is None or op.kind not in (Kind.FWD, Kind.BWD):
            continue
        low = plan.instrs[run[0 if op.kind is Kind.FWD else -1]].op
        cuts.setdefault(op.mb, set()).add(index[low.target])

    items: list[Item] = []
    for run in runs:
        op = plan.instrs[run[0]].op
        if op is None or op.kind not in (Kind.FWD, Kind.BWD):
            items.append(run[0])
            continue
        cut = cuts[op.mb]
        piece: list[int] = []
        for k in run:
            i = index[plan.instrs[k].op.target]
            # a forward piece ends before a cut; a backward piece ends at one
            if piece and op.kind is Kind.FWD and i in cut:
                items.append(_segment(plan, piece))
                piece = []
            piece.append(k)
            if op.kind is Kind.BWD and i in cut:
                items.append(_segment(plan, piece))
                piece = []
        if piece:
            items.append(_segment(plan, piece))
    return items


def _segment(plan: Plan, ks: list[int]) -> Segment:
    ops = [plan.instrs[k].op for k in ks]
    return Segment(ops[0].kind, ops[0].mb, tuple(op.target for op in ops), ks[0])
