"""The op vocabulary: what a node of the schedule graph is, with one text form that parses back.

    fwd[h.3]@mb1             forward of layer h.3 in micro-step 1
    bwd[embed]@mb0           backward of layer embed in micro-step 0
    recompute[h.3]@mb1       forward of h.3 again, from its kept input, right before its bwd
    allreduce[b1]@mb3        all-reduce (average) of bucket b1's gradients
    allreduce[u2]@mb3        HSDP: all-reduce of unit u2's gradient shard over the replicate
                             dimension, after its reduce-scatter over the shard dimension
    allgather[u2]@mb0:fwd    all-gather of unit u2's shards, for its forward use
    free[u2]@mb0:fwd         release of u2's gathered parameters after that use
    reducescatter[u2]@mb1    reduce-scatter (average) of u2's gradient into the shards
    optimizer.step           the update, once per step

`Op.parse(str(op)) == op` for every op (tested). The text is the node key in the networkx
graph, the name of each profiler range and trace event, and what programs in a .sched file
are written in.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple


class Kind(str, Enum):
    FWD = "fwd"
    BWD = "bwd"
    RECOMPUTE = "recompute"
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    REDUCESCATTER = "reducescatter"
    FREE = "free"
    STEP = "optimizer.step"

    @property
    def is_collective(self) -> bool:
        return self in COLLECTIVES

    @property
    def is_compute(self) -> bool:
        """Work that belongs on the compute stream (free releases memory that compute used)."""
        return not self.is_collective


COLLECTIVES = frozenset({Kind.ALLREDUCE, Kind.ALLGATHER, Kind.REDUCESCATTER})
REDUCTIONS = frozenset({Kind.ALLREDUCE, Kind.REDUCESCATTER})


class Phase(str, Enum):
    """Which pass a unit's gather or free serves."""

    FWD = "fwd"
    BWD = "bwd"


COMPUTE = "compute"  # the default stream of fwd, bwd, free and the optimizer
COMM = "comm"  # the default stream of collectives


class Op(NamedTuple):
    kind: Kind
    target: str = ""  # a layer (fwd/bwd/recompute), bucket (allreduce) or unit (gather/free/RS)
    mb: int = -1  # micro-step; -1 for the optimizer step
    phase: Phase | None = None  # allgather and free only

    def __str__(self) -> str:
        if self.kind is Kind.STEP:
            return Kind.STEP.value
        text = f"{self.kind.value}[{self.target}]@mb{self.mb}"
        return f"{text}:{self.phase.value}" if self.phase else text

    def __repr__(self) -> str:
        return f"Op({str(self)!r})"

    @property
    def is_collective(self) -> bool:
        return self.kind.is_collective

    @classmethod
    def parse(cls, text: str) -> Op:
        """Inverse of str(); raises OpSyntaxError saying what is wrong with the text."""
        text = text.strip()
        if text == Kind.STEP.value:
            return STEP
        m = _OP_RE.fullmatch(text)
        if not m:
            raise OpSyntaxError(
                f"'{text}' is not an op; ops read like bwd[h.3]@mb1, allgather[u2]@mb0:fwd "
                "or optimizer.step"
            )
        kind_text, target, mb, phase = m.group("kind", "target", "mb", "phase")
        try:
            kind = Kind(kind_text)
        except ValueError:
            raise OpSyntaxError(
                f"unknown op kind '{kind_text}'", suggest=(kind_text, [k.value for k in Kind])
            ) from None
        if not target:
            raise OpSyntaxError(f"'{text}' names no {kind.value} target inside [...]")
        if mb is None:
            raise OpSyntaxError(f"'{text}' names no micro-step; write @mb0, @mb1, ...")
        needs_phase = kind in (Kind.ALLGATHER, Kind.FREE)
        if needs_phase and phase is None:
            raise OpSyntaxError(f"{kind.value} needs a phase: '{text}:fwd' or '{text}:bwd'")
        if not needs_phase and phase is not None:
            raise OpSyntaxError(f"{kind.value} takes no phase; drop ':{phase}'")
        try:
            ph = Phase(phase) if phase is not None else None
        except ValueError:
            raise OpSyntaxError(f"phase '{phase}' is neither fwd nor bwd") from None
        if len(mb) > 18:  # int() refuses thousands of digits; no step has 10**18 micro-steps
            raise OpSyntaxError(f"micro-step number {mb[:12]}... is too large")
        return cls(kind, target, int(mb), ph)


_OP_RE = re.compile(
    r"(?P<kind>[A-Za-z_][A-Za-z0-9_.]*)\[(?P<target>[^\]\s]*)\]"
    r"(?:@mb(?P<mb>[0-9]+))?(?::(?P<phase>[A-Za-z]+))?"
)

STEP = Op(Kind.STEP)


class OpSyntaxError(ValueError):
    def __init__(self, message: str, suggest: tuple[str, list[str]] | None = None):
        super().__init__(message)
        self.suggest = suggest


def fwd(layer: str, mb: int) -> Op:
    return Op(Kind.FWD, layer, mb)


def bwd(layer: str, mb: int) -> Op:
    return Op(Kind.BWD, layer, mb)


def recompute(layer: str, mb: int) -> Op:
    return Op(Kind.RECOMPUTE, layer, mb)
