"""DDP's step (and one process's) as a canonical sequence: fwd every layer, then bwd in
reverse, each bucket all-reduced as soon as it and every bucket before it are complete."""

from __future__ import annotations

from schedc.ir.op import STEP, Kind, Op, bwd, fwd
from schedc.ir.spec import Spec
from schedc.passes.payloads import Need
from schedc.passes.sequence import OpSequence, backward_order, compute_needs, span_of_compute


def ddp_sequence(spec: Spec) -> OpSequence:
    """The step of a DDP schedule, or of one process (no buckets, nothing to reduce)."""
    seq = OpSequence()
    writers = [spec.writers(b.params) for b in spec.buckets]  # bucket -> its writing layers
    for j in range(spec.accum):
        for layer in spec.model.layers:
            op = fwd(layer, j)
            seq.emit(op, compute_needs(spec, op), span_of_compute(spec, op))
        _backward(spec, seq, j, writers)
    last = spec.accum - 1
    if spec.buckets:
        step_needs = [(Op(Kind.ALLREDUCE, b.name, last), Need.UPDATE) for b in spec.buckets]
    else:
        step_needs = [(bwd(layer, last), Need.GRADS) for layer in spec.model.layers]
    seq.emit(STEP, step_needs, spec.where.get("optimizer", spec.where.get("model")))
    return seq


def _backward(spec: Spec, seq: OpSequence, j: int, writers: list[frozenset[str]]) -> None:
    """Micro-step j's backward, each bucket's all-reduce right after the backward that
    completes it (when j communicates)."""
    buckets = spec.buckets
    done: set[str] = set()
    launched = 0
    for op in backward_order(spec, j):
        needs = compute_needs(spec, op)
        if op.kind is Kind.BWD and j and spec.communicates(j - 1):
            # this backward writes into buckets the previous all-reduce may still read
            needs += [
                (Op(Kind.ALLREDUCE, b.name, j - 1), Need.REUSE)
                for b, ws in zip(buckets, writers)
                if op.target in ws
            ]
        seq.emit(op, needs, span_of_compute(spec, op))
        if op.kind is not Kind.BWD or not spec.communicates(j):
            continue
        done.add(op.target)
        # launch in the compiled bucket order, never first-ready: every rank must agree
        while launched < len(buckets) and writers[launched] <= done:
            b = buckets[launched]
            seq.emit(
                Op(Kind.ALLREDUCE, b.name, j),
                [(bwd(w, j), Need.GRADS) for w in sorted(writers[launched])],
                b.span or spec.where.get("ddp"),
            )
            launched += 1
