"""The canonical sequence: the whole step in the order a host would issue it.

fwd, bwd, and each collective the moment its inputs are complete; every op listed after
the ops it needs, with why (`Need`) and the source line it comes from. passes/ddp.py and
passes/fsdp.py lay out their strategies' steps with what is here; passes/graph.py projects
the sequence onto streams.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from schedc.ir.op import Kind, Op, bwd, fwd, recompute
from schedc.ir.source import Span
from schedc.ir.spec import Spec
from schedc.passes.payloads import Need


@dataclass
class OpSequence:
    """Ops in canonical order, each with its needs and the source line it comes from."""

    ops: list[Op] = field(default_factory=list)
    needs: dict[Op, list[tuple[Op, Need]]] = field(default_factory=lambda: defaultdict(list))
    span: dict[Op, Span | None] = field(default_factory=dict)

    def emit(self, op: Op, needs: Iterable[tuple[Op, Need]] = (), span: Span | None = None) -> Op:
        self.ops.append(op)
        self.needs[op].extend(needs)
        self.span[op] = span
        return op


def compute_needs(spec: Spec, op: Op) -> list[tuple[Op, Need]]:
    """What a fwd, recompute or bwd reads from the compute before it."""
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


def span_of_compute(spec: Spec, op: Op) -> Span | None:
    if op.kind is Kind.RECOMPUTE:
        return spec.where.get("recompute") or spec.where.get("fsdp.recompute")
    return spec.where.get("model")


def backward_order(spec: Spec, mb: int) -> list[Op]:
    """One micro-step's backward, last layer first, each recompute right before its bwd
    (the shortest lifetime for what it rebuilds)."""
    return [
        again
        for layer in reversed(spec.model.layers)
        for again in (
            [recompute(layer, mb), bwd(layer, mb)] if layer in spec.recompute else [bwd(layer, mb)]
        )
    ]


def compute_order(spec: Spec) -> list[Op]:
    """Every fwd, recompute and bwd of the step, in the order the compute stream runs them."""
    layers = spec.model.layers
    return [
        op
        for j in range(spec.accum)
        for op in [fwd(layer, j) for layer in layers] + backward_order(spec, j)
    ]
