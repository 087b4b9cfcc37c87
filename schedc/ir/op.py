"""The op vocabulary of every schedule, data-parallel and pipelined: one `Kind`, one `Op`, one
text form that parses back.

A data-parallel plan runs ops on layers, buckets and units:

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

A pipeline program runs ops on stages (a stage is a range of layers; its F is their fwds in
order) and moves tensors between the ranks that hold them, in torch.distributed.pipelining's
letters (`_ComputationType`):

    F[s1]@mb0                forward of stage 1 for micro-batch 0
    B[s1]@mb0                full backward (input and weight gradients) of stage 1
    I[s1]@mb0                input-gradient half of the backward (zero-bubble schedules)
    W[s1]@mb0                weight-gradient half, after its I
    SEND_F[s0]@mb0           stage 0 sends micro-batch 0's activation to stage 1's rank
    RECV_F[s1]@mb0           stage 1 receives it (from stage 0's rank)
    SEND_B[s1]@mb0           stage 1 sends the gradient of its input to stage 0's rank
    RECV_B[s0]@mb0           stage 0 receives it
    SEND_F[s0]@mb0:c1        the same on communicator c1 (the default is `pp`)

A send names its own stage and a receive its own (as torch's `_Action` does), so
SEND_F[s]@m pairs with RECV_F[s+1]@m and SEND_B[s]@m with RECV_B[s-1]@m.

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
    # a pipeline stage's compute, and its point-to-point transfers
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (the paper's and torch's name)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_collective(self) -> bool:
        return self in COLLECTIVES

    @property
    def is_compute(self) -> bool:
        """Work that belongs on the compute stream (free releases memory that compute used)."""
        return not self.is_collective and not self.is_p2p

    @property
    def on_stage(self) -> bool:
        """Whether the op acts on a pipeline stage (F, B, I, W and the transfers) rather
        than on a layer, bucket or unit."""
        return self in STAGE_KINDS

    @property
    def is_p2p(self) -> bool:
        return self in P2P

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def forward(self) -> bool:
        """Whether a transfer carries an activation (F) rather than an input gradient (B)."""
        return self in (Kind.SEND_F, Kind.RECV_F)


COLLECTIVES = frozenset({Kind.ALLREDUCE, Kind.ALLGATHER, Kind.REDUCESCATTER})
REDUCTIONS = frozenset({Kind.ALLREDUCE, Kind.REDUCESCATTER})
P2P = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
STAGE_COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
STAGE_KINDS = frozenset({*STAGE_COMPUTE, *P2P})
PLAN_KINDS = tuple(k for k in Kind if k not in STAGE_KINDS)  # what a data-parallel plan runs
DEFAULT_COMM = "pp"  # the communicator of a transfer that names none


class Phase(str, Enum):
    """Which pass a unit's gather or free serves."""

    FWD = "fwd"
    BWD = "bwd"


COMPUTE = "compute"  # the default stream of fwd, bwd, free and the optimizer
COMM = "comm"  # the default stream of collectives


class Op(NamedTuple):
    kind: Kind
    target: str = ""  # a layer (fwd/bwd/recompute), bucket (allreduce) or unit (gather/free/RS)
    mb: int = -1  # micro-step (a pipeline's micro-batch); -1 for the optimizer step
    phase: Phase | None = None  # allgather and free only
    stage: int = -1  # a stage op's stage (`stage_op` makes them)
    comm: str = ""  # a stage op's communicator (DEFAULT_COMM: used by transfers only)

    def __str__(self) -> str:
        if self.kind is Kind.STEP:
            return Kind.STEP.value
        if self.kind.on_stage:
            suffix = f":{self.comm}" if self.kind.is_p2p and self.comm != DEFAULT_COMM else ""
            return f"{self.kind.value}[s{self.stage}]@mb{self.mb}{suffix}"
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
        if text.split("[", 1)[0] in _STAGE_TEXT:
            return _stage_parse(text)
        return _plan_parse(text)

    # -- a stage op's transfer: where it goes and what it carries -------------------------

    @property
    def edge(self) -> tuple[int, int]:
        """(from stage, to stage) of a transfer, the same for a send and its receive."""
        if self.kind is Kind.SEND_F:
            return (self.stage, self.stage + 1)
        if self.kind is Kind.RECV_F:
            return (self.stage - 1, self.stage)
        if self.kind is Kind.SEND_B:
            return (self.stage, self.stage - 1)
        if self.kind is Kind.RECV_B:
            return (self.stage + 1, self.stage)
        raise ValueError(f"{self} is no transfer")

    @property
    def tag(self) -> tuple[tuple[int, int], int, bool]:
        """What a transfer carries: (stage edge, micro-batch, forward); a send and the
        receive it is meant for have the same tag."""
        return (self.edge, self.mb, self.kind.forward)

    @property
    def peer_stage(self) -> int:
        """The stage at the other end of a transfer."""
        a, b = self.edge
        return b if self.kind.is_send else a


def stage_op(kind: Kind, stage: int, mb: int, comm: str = DEFAULT_COMM) -> Op:
    """An op of a pipeline program: `kind` (F, B, I, W or a transfer) of `stage` for
    micro-batch `mb`, a transfer on communicator `comm`."""
    return Op(kind, "", mb, None, stage, comm)


_STAGE_TEXT = frozenset(k.value for k in STAGE_KINDS)
# ASCII digits: Python's \d is any script's digit, and int('٣') is 3
_STAGE_RE = re.compile(
    r"(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)\[s([0-9]+)\]@mb([0-9]+)(?::([A-Za-z0-9_.-]+))?"
)


def _stage_parse(text: str) -> Op:
    m = _STAGE_RE.fullmatch(text)
    if not m:
        raise OpSyntaxError(f"not a pipeline action: {text!r}")
    kind = Kind(m.group(1))
    comm = m.group(4) or DEFAULT_COMM
    if comm != DEFAULT_COMM and not kind.is_p2p:
        raise OpSyntaxError(f"a compute action has no communicator: {text!r}")
    if len(m.group(2)) > 18 or len(m.group(3)) > 18:
        raise OpSyntaxError(f"{text[:40]!r}: a stage or micro-batch number is too large")
    return stage_op(kind, int(m.group(2)), int(m.group(3)), comm)


def _plan_parse(text: str) -> Op:
    """A data-parallel op: a kind, its target in brackets, @mbN and a gather's phase."""
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
            f"unknown op kind '{kind_text}'", suggest=(kind_text, [k.value for k in PLAN_KINDS])
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
    return Op(kind, target, int(mb), ph)


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
