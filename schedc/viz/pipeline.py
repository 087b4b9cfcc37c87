"""The pipeline grid: a pipeline schedule's step as the classic picture, predicted from the
simulation at the plan's costs (or at measured ones), or measured from a trace, as DOT for
`neato -n2` (fixed positions).

    grid_of(compiled)                 -> Grid   simulated at the plan's unit costs
    grid_of(compiled, costs, said)    -> Grid   simulated at measured costs (ms)
    measured_grid(compiled, m, said)  -> Grid   a traced step (analysis/pipeline_trace.py)
    pipeline_dot(grids)               -> DOT text  stacked on one time scale

One row per pipeline rank, time left to right in units of one stage's forward; one box per
compute action (F, B, or I and W), as wide as its cost, labelled by micro-batch (and stage
when a rank holds several); where a rank computes nothing (waiting on a transfer, the fill
and the drain) its lane shows through: the bubble. Each transfer is an arrow from the box
that produced what it carries (sender's rank) to the box that reads it (receiver's rank).
Predicted times are passes/pipeline_sim.py's over the proof's happens-before graph, the same
that gave the plan its bubble, so the drawn idle share of each row is the plan's bubble; a
measured grid draws each item from its traced start to its end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from schedc.analysis.pipeline_trace import Measured
from schedc.compiler import Compiled
from schedc.ir.op import Kind, Op, stage_op
from schedc.ir.pipeline import backward_kind, producer
from schedc.passes.pipeline_plan import PipelinePlan
from schedc.passes.pipeline_sim import Costs, simulate
from schedc.viz.dot import COLORS, attrs, q
from schedc.viz.timeline.canvas import GREY, INK, LEFT, WIDTH, Canvas, fits

# (fill, stroke): forward and full backward as every schedc picture draws them; the split
# backward's input half I a deeper green (it is the backward on the critical path), its
# weight half W amber (deferrable: it fills what would be bubble)
PP_COLORS = {
    Kind.F: COLORS[Kind.FWD],
    Kind.B: COLORS[Kind.BWD],
    Kind.I: ("#69db7c", "#2b8a3e"),
    Kind.W: ("#ffe066", "#e67700"),
}
WHAT = {
    Kind.F: "F: forward of a stage",
    Kind.B: "B: backward (input and weight gradients)",
    Kind.I: "I: input-gradient half of the backward",
    Kind.W: "W: weight-gradient half, deferred",
}
ROW = 30.0  # one rank's lane
GAP = 10.0  # between lanes: where the arrows run
LANE_FILL, LANE_STROKE = "#f1f3f5", "#dee2e6"


@dataclass(frozen=True)
class Slot:
    """A compute action of a rank's program, where it runs in the simulated step."""

    rank: int
    index: int  # its item's position in the rank's program
    action: Op
    start: float
    end: float


@dataclass(frozen=True)
class Transfer:
    """A send, drawn from the compute that produced it to the compute that reads it."""

    send: Op
    src: Slot
    dst: Slot


@dataclass(frozen=True)
class Grid:
    """One pipeline schedule's step, simulated or measured: what is drawn of it."""

    name: str
    compiled: Compiled
    plan: PipelinePlan
    slots: dict[int, list[Slot]]  # rank -> compute actions in program order
    transfers: list[Transfer]
    step: float  # the step's length, in `unit`
    bubble: dict[int, float]  # rank -> idle share, as the grid's source says it
    said: str  # the subtitle: what the times are
    unit: str = ""  # "" (one stage's F = 1) or "ms"

    def idle(self, rank: int) -> float:
        """The share of the step `rank` computes nothing, from its slots."""
        busy = sum(s.end - s.start for s in self.slots[rank])
        return (self.step - busy) / self.step if self.step else 0.0


def grid_of(compiled: Compiled, costs: Costs | None = None, said: str = "") -> Grid:
    """The plan's programs timed as passes/pipeline_plan.py timed them (proof, simulation),
    at the plan's unit costs or at `costs` (measured ones, in ms: then `said` says so)."""
    plan = compiled.pipeline
    assert plan is not None
    timing = simulate(plan.graph, costs or plan.costs)
    times = {k: (timing.starts[k], timing.ends[k]) for k in timing.starts}
    if costs is None:
        bubble = ", ".join(
            f"{who(compiled, r)} {100 * b:.1f}%" for r, b in sorted(plan.bubble.items())
        )
        said = (
            f"predicted at {plan.cost_words}: step {plan.step:g} (one stage's F = 1); "
            f"bubble {bubble}"
        )
    unit = "" if costs is None else "ms"
    return _grid(compiled, times, timing.step, timing.bubble, said, unit)


def measured_grid(compiled: Compiled, measured: Measured, said: str) -> Grid:
    """A traced step (analysis/pipeline_trace.py `measure`), in ms from its start."""
    return _grid(compiled, measured.times, measured.step, measured.bubble, said, "ms")


def _grid(
    compiled: Compiled,
    times: dict[tuple[int, int], tuple[float, float]],
    step: float,
    bubble: dict[int, float],
    said: str,
    unit: str,
) -> Grid:
    plan = compiled.pipeline
    assert plan is not None
    slots: dict[int, list[Slot]] = {}
    for r, program in sorted(plan.programs.items()):
        slots[r] = [
            Slot(r, i, item[0], *times[(r, i)])
            for i, item in enumerate(program)
            if not item[0].kind.is_p2p
        ]
    at = {s.action: s for row in slots.values() for s in row}
    back = backward_kind(at)
    transfers = []
    for _, program in sorted(plan.programs.items()):
        for item in program:
            for a in (a for a in item if a.kind.is_send):
                peer = a.peer_stage
                # what the receive brings is read by the peer stage's F, or its B / I
                reader = stage_op(Kind.F if a.kind.forward else back, peer, a.mb)
                recv = stage_op(Kind.RECV_F if a.kind.forward else Kind.RECV_B, peer, a.mb)
                transfers.append(Transfer(a, at[producer(recv, back)], at[reader]))
    name = Path(compiled.source.path).name
    return Grid(name, compiled, plan, slots, transfers, step, bubble, said, unit)


# -- drawing --------------------------------------------------------------------------------


class GridCanvas(Canvas):
    """The timeline's canvas with arrows: an edge between two invisible pinned points."""

    def arrow(self, a: tuple[float, float], b: tuple[float, float], color: str, tip: str) -> None:
        ends = []
        for x, y in (a, b):
            ends.append(self._id())
            self.lines.append(
                f"  {ends[-1]} "
                + attrs(pos=q(f"{x:.2f},{-y:.2f}!"), shape="point", width="0.01", style="invis")
            )
        self.lines.append(
            f"  {ends[0]} -> {ends[1]} "
            + attrs(
                color=q(color),
                penwidth="0.9",
                arrowsize="0.45",
                tooltip=q(tip),
                **{"class": q("pp_transfer")},
            )
        )


@dataclass(frozen=True)
class Scale:
    points: float  # per unit of time

    def x(self, t: float) -> float:
        return LEFT + t * self.points


def pipeline_dot(grids: list[Grid], width: float = WIDTH) -> str:
    """Every grid on one time scale, stacked, then the legend."""
    cv = GridCanvas()
    longest = max((g.step for g in grids), default=0.0) or 1.0
    sc = Scale(width / longest)
    y = 0.0
    for g in grids:
        y = _draw(cv, g, sc, y) + 24
    _legend(cv, grids, y)
    return cv.dot()


def title(g: Grid) -> str:
    spec, pipe = g.compiled.spec, g.plan.pipeline
    assert spec.pipeline is not None
    each = f" ({pipe.per_rank} each, {pipe.placement.value} placement)"
    held = each if pipe.per_rank > 1 else ""
    ranks = f"{pipe.pp} ranks"
    if spec.dp > 1:  # each row is a pipeline rank, run by dp replicas (rank = pp x dp + d)
        ranks = f"{pipe.pp} pipeline ranks x {spec.dp} replicas (world {spec.world})"
    return (
        f"{g.name}: {spec.pipeline.schedule.value}, {pipe.stages} stages on {ranks}"
        f"{held}, {pipe.microbatches} micro-batches"
    )


def who(c: Compiled, r: int) -> str:
    """A row's name: `rank r`, or with data parallelism the ranks that run pipeline rank r
    (pp-outermost: r x dp + d for each replica d)."""
    dp = c.spec.dp
    if dp == 1:
        return f"rank {r}"
    return "ranks " + ", ".join(str(r * dp + d) for d in range(dp))


def _draw(cv: GridCanvas, g: Grid, sc: Scale, y: float) -> float:
    """A grid: its title, one lane per rank with its boxes, the transfers, the axis."""
    cv.text(0, y, title(g), size=14, bold=True)
    cv.text(0, y + 20, g.said, size=10, color="#495057")
    y += 44
    pipe, right = g.plan.pipeline, sc.x(g.step)
    top = {r: y + k * (ROW + GAP) for k, r in enumerate(sorted(g.slots))}
    for r, row_y in top.items():
        cv.box(LEFT, row_y, right - LEFT, ROW, fill=LANE_FILL, stroke=LANE_STROKE)
        held = ", ".join(f"s{s}" for s in pipe.stages_of(r))
        cv.text(LEFT - 8, row_y + ROW / 2 - 13, f"{who(g.compiled, r)}\n{held}", size=10, align="r")
        for s in g.slots[r]:
            _box(cv, s, sc, row_y, pipe.per_rank > 1)
        cv.text(right + 8, row_y + ROW / 2 - 7, f"bubble {100 * g.idle(r):.1f}%", size=10)
    for t in g.transfers:
        _transfer(cv, t, sc, top)
    y = top[max(top)] + ROW + 6
    return _axis(cv, sc, g.step, y, g.unit)


def _box(cv: GridCanvas, s: Slot, sc: Scale, y: float, stages: bool) -> None:
    fill, stroke = PP_COLORS[s.action.kind]
    x0, x1 = sc.x(s.start), sc.x(s.end)
    name = f"{s.action.kind.value}{s.action.mb}"
    words = [f"{name}\ns{s.action.stage}", f"{s.action.mb}"] if stages else [name, f"{s.action.mb}"]
    size = 9 if stages else 10
    label = next((w for w in words if fits(w, x1 - x0, size)), "")
    cv.box(
        x0,
        y + 2,
        x1 - x0,
        ROW - 4,
        fill=fill,
        stroke=stroke,
        label=label,
        size=size,
        tooltip=f"rank {s.rank}: {s.action} {s.start:g}..{s.end:g}",
        cls=f"pp_{s.action.kind.value}",
    )


def _transfer(cv: GridCanvas, t: Transfer, sc: Scale, top: dict[int, float]) -> None:
    """From the producer's end, on its lane's edge facing the receiver, to the reader's start."""
    ys, yd = top[t.src.rank], top[t.dst.rank]
    down = yd > ys
    a = (sc.x(t.src.end), ys + (ROW - 2 if down else 2))
    b = (sc.x(t.dst.start), yd + (2 if down else ROW - 2))
    color = PP_COLORS[Kind.F][1] if t.send.kind.forward else PP_COLORS[Kind.B][1]
    cv.arrow(a, b, color, f"{t.send}: rank {t.src.rank} -> rank {t.dst.rank}")


def _axis(cv: GridCanvas, sc: Scale, step: float, y: float, unit: str) -> float:
    cv.box(LEFT, y, step * sc.points, 1.0, fill=INK)
    every = next((k for k in (1, 2, 5, 10, 20, 50, 100, 1000) if step / k <= 24), 0.0)
    if not every:  # a measured step of minutes (or a trace's clock of years): 1, 2 or 5 x 10^n
        tens = 10.0 ** math.floor(math.log10(step / 24))
        every = next(k * tens for k in (1, 2, 5, 10) if step / (k * tens) <= 24)
    t = 0.0
    while t <= step + 1e-9:
        cv.box(sc.x(t) - 0.5, y, 1.0, 4.0, fill=INK)
        cv.text(sc.x(t), y + 5, f"{t:g} {unit}" if t == 0 and unit else f"{t:g}", size=9, align="c")
        t += every
    return y + 20


def _legend(cv: GridCanvas, grids: list[Grid], y: float) -> None:
    """The kinds drawn, the two arrows and what a gap is."""
    kinds = [
        k
        for k in PP_COLORS
        if any(s.action.kind is k for g in grids for r in g.slots.values() for s in r)
    ]
    x = LEFT
    for k in kinds:
        fill, stroke = PP_COLORS[k]
        cv.box(x, y, 26, 16, fill=fill, stroke=stroke, label=k.value, size=9)
        x += 32 + cv.text(x + 30, y + 1, WHAT[k], size=10)
    y += 24
    x = LEFT
    for color, words in (
        (PP_COLORS[Kind.F][1], "activation sent to the next stage's rank (SEND_F -> RECV_F)"),
        (PP_COLORS[Kind.B][1], "input gradient sent back (SEND_B -> RECV_B)"),
    ):
        cv.arrow((x, y + 8), (x + 26, y + 8), color, words)
        x += 32 + cv.text(x + 30, y + 1, words, size=10)
    cv.box(x, y, 26, 16, fill=LANE_FILL, stroke=LANE_STROKE)
    cv.text(
        x + 30,
        y + 1,
        "idle: the bubble (waiting for a transfer, the fill and the drain)",
        size=10,
        color=GREY,
    )
