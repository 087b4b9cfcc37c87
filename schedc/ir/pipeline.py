"""Pipeline programs: per-rank lists of items, each one stage op (ir/op.py: F, B, I, W) or a
group of transfers issued together (`batch_isend_irecv`), written joined by `+`:
`SEND_F[s0]@mb1+RECV_B[s0]@mb0`; and where a pipeline's stages run (`Pipeline`).
`parse_program(format_program(p)) == p` (tested).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from schedc.ir.op import Kind, Op, stage_op
from schedc.ir.plan import Instr

Item = tuple[Op, ...]  # one action, or a group of transfers issued together


class Placement(str, Enum):
    LOOP = "loop"  # stage s on rank s % pp
    V = "v"  # chunk c of rank r: stage c * pp + r for even c, (c + 1) * pp - 1 - r for odd


@dataclass(frozen=True)
class Pipeline:
    """How many ranks, stages and micro-batches, and where each stage runs."""

    pp: int
    stages: int
    microbatches: int
    placement: Placement = Placement.LOOP

    def __post_init__(self) -> None:
        if self.pp < 1 or self.microbatches < 1 or self.stages < self.pp:
            raise ValueError(f"pipeline needs pp >= 1, m >= 1, stages >= pp: {self}")
        if self.stages % self.pp:
            raise ValueError(f"{self.stages} stages do not divide over {self.pp} ranks")

    @property
    def per_rank(self) -> int:
        return self.stages // self.pp

    def rank_of(self, stage: int) -> int:
        chunk, pos = divmod(stage, self.pp)
        if self.placement is Placement.V and chunk % 2:
            return self.pp - 1 - pos
        return pos

    def stages_of(self, rank: int) -> list[int]:
        """The rank's stages in order: in chunk c, the position `rank_of` maps to `rank`."""
        if not 0 <= rank < self.pp:
            return []
        v = self.placement is Placement.V
        return [c * self.pp + (self.pp - 1 - rank if v and c % 2 else rank)
                for c in range(self.per_rank)]  # fmt: skip

    def peer(self, action: Op) -> int:
        """The rank at the other end of a transfer."""
        return self.rank_of(action.peer_stage)

    def local(self, a: int, b: int) -> bool:
        """Whether stages a and b are on one rank (their tensors need no transfer)."""
        return self.rank_of(a) == self.rank_of(b)


class Schedule(str, Enum):
    """The named schedules (passes/pipeline_gen.py generates their programs)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved-1f1b"
    ZB_H1 = "zb-h1"
    ZB_V = "zb-v"

    @property
    def placement(self) -> Placement:
        """Where the schedule puts its stages: ZB-V's two a rank in a V, the rest in a loop."""
        return Placement.V if self is Schedule.ZB_V else Placement.LOOP

    @property
    def splits_backward(self) -> bool:
        """Whether each backward is split into I and W (the zero-bubble schedules)."""
        return self in (Schedule.ZB_H1, Schedule.ZB_V)


class Written(str, Enum):
    """A pipeline whose programs are written in the file (`program on rank N { ... }`), in
    place of a named schedule's."""

    PROGRAMS = "written"


Programs = dict[int, list[Item]]  # rank -> items in issue order


def format_item(item: Item) -> str:
    return "+".join(str(a) for a in item)


def format_program(program: list[Item]) -> str:
    return " ".join(format_item(i) for i in program)


def parse_program(text: str) -> list[Item]:
    return [tuple(_stage(a) for a in word.split("+")) for word in text.split()]


def _stage(text: str) -> Op:
    op = Op.parse(text)
    if not op.kind.on_stage:
        raise ValueError(f"not a pipeline action: {text!r}")
    return op


def items_of(instrs: Iterable[Instr]) -> list[Item]:
    """A bound plan's stage ops as the program items they run as: each compute alone, each
    transfer with those it is posted with (`Instr.batched`); collectives left out."""
    out: list[list[Op]] = []
    for i in instrs:
        if i.op is None or not i.op.kind.on_stage:
            continue
        if i.batched and out and out[-1][0].kind.is_p2p:
            out[-1].append(i.op)
        else:
            out.append([i.op])
    return [tuple(item) for item in out]


def actions(program: list[Item]) -> list[Op]:
    return [a for item in program for a in item]


def side_by_side(
    programs: Programs,
    ranks: list[int],
    marks: dict[tuple[int, int], str],
    around: int | None = None,
) -> str:
    """Columns of the ranks' programs, one item a row; `marks[(rank, index)]` is printed
    next to that item (where a cycle passes, say). With `around`, only the rows within
    that many of a marked row are shown, a gap as `...`."""
    cols = []
    for r in ranks:
        cells = [f"{i:>3} {format_item(it)}{marks.get((r, i), '')}" for i, it in
                 enumerate(programs.get(r, []))]  # fmt: skip
        cols.append([f"rank {r}", *cells])
    width = [max(len(c) for c in col) + 2 for col in cols]
    rows = max(len(col) for col in cols)
    shown = list(range(rows))
    if around is not None:
        near = {i + 1 + d for _, i in marks for d in range(-around, around + 1)}
        shown = [k for k in range(rows) if k == 0 or k in near]
    out = []
    for k, prev in zip(shown, [-1, *shown]):
        if k > prev + 1:
            out.append("  ...")
        cells = [(col[k] if k < len(col) else "").ljust(w) for col, w in zip(cols, width)]
        out.append("".join(cells).rstrip())
    if shown and shown[-1] < rows - 1:
        out.append("  ...")
    return "\n".join(out)


# -- what each action reads: the one rule the generator, the checker and the simulator share --


def needs(pipe: Pipeline, act: Op, backward: Kind = Kind.B) -> list[Op]:
    """The actions whose results `act` reads, all on act's rank: its stage's forward, the
    neighbour stage's output when that stage is local, else the receive that brings it.
    `backward` is the kind that produces an input gradient: B, or I in a split schedule."""
    s, m = act.stage, act.mb
    if act.kind is Kind.F:
        if s == 0:
            return []
        return [stage_op(Kind.F, s - 1, m) if pipe.local(s - 1, s) else stage_op(Kind.RECV_F, s, m)]
    if act.kind in (Kind.B, Kind.I):
        out = [stage_op(Kind.F, s, m)]
        if s + 1 < pipe.stages:
            local = pipe.local(s + 1, s)
            out.append(stage_op(backward, s + 1, m) if local else stage_op(Kind.RECV_B, s, m))
        return out
    if act.kind is Kind.W:
        return [stage_op(Kind.I, s, m)]
    if act.kind is Kind.SEND_F:
        return [stage_op(Kind.F, s, m)]
    if act.kind is Kind.SEND_B:
        return [stage_op(backward, s, m)]
    return []


def last_grad_writers(program: list[Item]) -> dict[int, Op]:
    """Each stage's last B or W in a rank's program: the stage's weight gradients are final
    after it (where the executor launches their reduction and the ledger counts it)."""
    last: dict[int, Op] = {}
    for item in program:
        for act in item:
            if act.kind in (Kind.B, Kind.W):
                last[act.stage] = act
    return last


def producer(recv: Op, backward: Kind = Kind.B) -> Op:
    """The compute whose output a receive brings (on the sending rank)."""
    if recv.kind is Kind.RECV_F:
        return stage_op(Kind.F, recv.stage - 1, recv.mb)
    return stage_op(backward, recv.stage + 1, recv.mb)


def step_actions(pipe: Pipeline, split: bool) -> tuple[int, int]:
    """(computes, transfers) in a step's programs: per micro-batch each stage's F and B (F,
    I and W where the backward is `split`), and a send and a receive each way across every
    stage edge between two ranks. What the proof, the simulator and the ledger walk."""
    crossings = sum(not pipe.local(s, s + 1) for s in range(pipe.stages - 1))
    m = pipe.microbatches
    return m * pipe.stages * (3 if split else 2), m * 4 * crossings


def backward_kind(acts: Iterable[Op]) -> Kind:
    """The kind that makes a stage's input gradient in these actions' schedule: I where the
    backward is split (zero bubble), else B."""
    return Kind.I if any(a.kind is Kind.I for a in acts) else Kind.B


def reader(recv: Op, backward: Kind = Kind.B) -> Op:
    """The compute on the receiving rank that reads what a receive brings (and so waits for
    it): the forward of its stage, or its stage's backward (B, or I in a split schedule)."""
    return stage_op(Kind.F if recv.kind is Kind.RECV_F else backward, recv.stage, recv.mb)
