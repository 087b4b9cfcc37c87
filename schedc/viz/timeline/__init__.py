"""The timeline view, in the seed pictures' style, as DOT for `neato -n2` (fixed positions).

Per rank one lane per stream (compute, comm), time left to right on one scale shared by
every panel; a box per op whose width is its duration. Consecutive forward (or backward)
ops of one micro-step that no event separates are drawn as one box (`bwd[h.1 .. embed]@mb3`)
unless --unfold; for FSDP a "gathered" lane shows each unit from its all-gather to its free.
A collective's time is split where the rank's compute stream is computing: hidden pieces
are drawn plain, exposed pieces striped, and the caption totals both per rank.

    panels_for(compiled, cost, ...) -> [Panel]    predicted (simulated) and/or measured
    timeline_dot(panels)             -> DOT text

A panel is drawn here, top to bottom, from its parts:

    panels.py   what is drawn: Panel, panels_for
    canvas.py   the DOT canvas of fixed positions, the time window (View, window_of)
    boxes.py    ops joined into boxes, their labels and marks
    lanes.py    a rank's lanes: boxes, hidden/exposed words, marks, micro-steps, gathered units
    legend.py   the axis, the caption, the table of marks, the legend
"""

from __future__ import annotations

from schedc.analysis.units import fmt_time
from schedc.ir.op import Kind, Op
from schedc.ir.spec import Strategy
from schedc.viz.graph import describe
from schedc.viz.timeline.boxes import Lanes, Names, box_names, boxes, marks
from schedc.viz.timeline.canvas import LANE, LEFT, NOTE, WIDTH, Canvas, View, window_of
from schedc.viz.timeline.lanes import draw_box, gathered, mark_row, markers, notes
from schedc.viz.timeline.legend import axis, caption, legend, table
from schedc.viz.timeline.panels import Panel


def timeline_dot(
    panels: list[Panel], unfold: bool = False, width: float = WIDTH, window: str | None = None
) -> str:
    """Every panel on one time scale; `window` (see window_of) crops each to part of its step."""
    cv = Canvas()
    spans = [window_of(p.timeline, window) for p in panels]
    longest = max((t1 - t0 for t0, t1 in spans), default=0.0) or 1e-9
    y = 0.0
    for p, (t0, t1) in zip(panels, spans):
        y = _panel(cv, p, y, View(t0, t1, width / longest), width, unfold) + 26
    legend(cv, y, panels)
    return cv.dot()


def _panel(cv: Canvas, p: Panel, y: float, v: View, width: float, unfold: bool) -> float:
    """A panel: its title, each rank's lanes, the axis, the caption and the table of marks."""
    tl, c = p.timeline, p.compiled
    cv.text(0, y, f"{p.name}: {describe(c)}", size=14, bold=True)
    y += 20
    cv.text(0, y, p.subtitle(), size=10, color="#495057")
    y += 20
    lanes: Lanes = {
        (r, s): [b for b in boxes(c, tl.on(r, s), r, unfold) if v.clip(b.start, b.end)]
        for r in tl.ranks
        for s in tl.streams
    }
    names = box_names(tl.spec, lanes, v)
    marked = marks(lanes, names)
    for r in tl.ranks:
        y = markers(cv, tl, r, y, v)
        for s in tl.streams:
            y = _lane(cv, p, (r, s), lanes, names, marked, v, y, width)
        if tl.spec.kind is Strategy.FSDP:
            y = gathered(cv, tl, r, v, y, width)
        y += 6
    y = axis(cv, y + 4, v, width)
    lines = caption(p)
    if v.t0 > 0 or v.t1 < tl.end:
        lines.append(
            f"drawn: {fmt_time(v.t0)} .. {fmt_time(v.t1)} of the {fmt_time(tl.end)} "
            "step (--window); the totals above are for the whole step"
        )
    for line in lines:
        cv.text(0, y, line, size=11)
        y += 15
    return table(cv, p, marked, y, LEFT + width)


def _lane(
    cv: Canvas,
    p: Panel,
    at: tuple[int, str],
    lanes: Lanes,
    names: Names,
    marked: dict[Op, int],
    v: View,
    y: float,
    width: float,
) -> float:
    """The lane of one rank's stream, `at` (rank, stream), and the rows under it: the
    hidden/exposed words of its collectives, or the marks of those too narrow to label."""
    (r, s), tl = at, p.timeline
    cv.box(LEFT, y, width, LANE, fill="#f8f9fa", stroke="#e9ecef")
    who = f"rank {r}\n" if len(tl.ranks) > 1 else ""
    cv.text(LEFT - 8, y + LANE / 2 - (15 if who else 8), f"{who}{s}\nstream", size=10, align="r")
    lane = lanes[at]
    # frees last: a free's tick lies on the edge of the boxes around it
    for b in sorted(lane, key=lambda b: b.op.kind is Kind.FREE):
        draw_box(cv, b, names[b.key], p.overlap[r], v, y + 3, LANE - 6, tl.spec)
    y += LANE + 2
    if any(b.op.is_collective and b.op not in marked for b in lane):
        mine = [x for x in p.overlap[r].items if x.interval.stream == s]
        notes(cv, [x for x in mine if x.interval.op not in marked], v, y)
        y += NOTE
    if any(b.op in marked for b in lane):
        y = mark_row(cv, [b for b in lane if b.op in marked], marked, v, y)
    return y
