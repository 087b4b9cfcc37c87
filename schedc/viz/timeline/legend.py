"""What a panel says beside its lanes: the time axis, the caption (per rank, communication
hidden and exposed), the table of the collectives too narrow to label, and the legend under
the whole picture."""

from __future__ import annotations

import math

from schedc.analysis.overlap import Exposure
from schedc.analysis.units import fmt_time
from schedc.ir.op import Kind, Op
from schedc.viz.dot import COLORS, REPLICATE_COLORS, colors_of
from schedc.viz.timeline.boxes import short
from schedc.viz.timeline.canvas import INK, LEFT, RED, Canvas, View, text_width
from schedc.viz.timeline.panels import Panel


def _share(x: Exposure) -> str:
    """`hidden`, `exposed`, or `40% hidden`: the words of a table row."""
    share = x.hidden / x.interval.length if x.interval.length > 0 else 1.0
    if share >= 0.99:
        return "hidden"
    return "exposed" if share <= 0.01 else f"{100 * share:.0f}% hidden"


def table(cv: Canvas, p: Panel, marks: dict[Op, int], y: float, right: float) -> float:
    """The marked collectives, one row each: mark, short name, IR text, and per rank its
    time and hidden/exposed split; in as many columns as fit the picture's width."""
    if not marks:
        return y
    y += 4
    cv.text(0, y, "collectives too narrow to label, by their mark under the lane:", size=10)
    y += 15
    rows = []
    for op, n in sorted(marks.items(), key=lambda kv: kv[1]):
        per = []
        for r, ov in p.overlap.items():
            mine = next((x for x in ov.items if x.interval.op == op), None)
            if mine is not None:
                who = "" if len(p.overlap) == 1 else f"rank {r} "
                per.append(f"{who}{fmt_time(mine.interval.length)}, {_share(mine)}")
        rows.append((str(n), f"{short(op)}  {op}: {'; '.join(per)}"))
    mark_w = max(text_width(m, 9) for m, _ in rows) + 8
    col_w = mark_w + max(text_width(t, 9) for _, t in rows) + 24
    cols = max(1, min(len(rows), int(right // col_w)))
    per_col = math.ceil(len(rows) / cols)
    for i, (m, text) in enumerate(rows):
        x, row_y = (i // per_col) * col_w, y + (i % per_col) * 13
        cv.text(x + mark_w - 4, row_y, m, size=9, align="r", bold=True, cls="legend_mark")
        cv.text(x + mark_w, row_y, text, size=9, cls="legend_row")
    return y + per_col * 13 + 4


def axis(cv: Canvas, y: float, v: View, width: float) -> float:
    cv.box(LEFT, y, width, 1.0, fill=INK)
    span = width / v.scale
    raw = span / 10
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    k = math.ceil(v.t0 / step - 1e-9)
    while k * step <= (v.t0 + span) * (1 + 1e-9):
        x = v.x(k * step)
        cv.box(x - 0.4, y, 0.8, 5, fill=INK)
        cv.text(x, y + 6, fmt_time(k * step), size=9, color="#495057", align="c")
        k += 1
    cv.text(LEFT + width + 4, y - 7, "time", size=10)
    return y + 24


def caption(p: Panel) -> list[str]:
    out = []
    for r, ov in p.overlap.items():
        who = "every rank" if p.timeline.every_rank else f"rank {r}"
        out.append(f"{who}: {ov.describe()}")
    return out


def legend(cv: Canvas, y: float, panels: list[Panel]) -> None:
    kinds = sorted(
        {
            i.op.kind
            for p in panels
            for i in p.timeline.intervals
            if colors_of(p.timeline.spec, i.op) == COLORS[i.op.kind]  # not HSDP's replicate
        },
        key=lambda k: list(Kind).index(k),
    )
    names = {
        Kind.FWD: "forward",
        Kind.BWD: "backward",
        Kind.RECOMPUTE: "recompute",
        Kind.FREE: "free",
        Kind.STEP: "optimizer step",
        Kind.ALLREDUCE: "all-reduce",
        Kind.ALLGATHER: "all-gather",
        Kind.REDUCESCATTER: "reduce-scatter",
    }
    x = 0.0
    for k in kinds:
        fill, stroke = COLORS[k]
        if k is Kind.FREE:  # drawn as a tick (see lanes.draw_box)
            cv.box(x + 7.2, y - 2, 1.6, 14, fill="#495057")
        else:
            cv.box(x, y, 16, 10, fill=fill, stroke=stroke, pen=0.8)
        x += 20 + cv.text(x + 20, y - 2, names[k], size=10)
    if any(p.timeline.spec.hsdp for p in panels):
        fill, stroke = REPLICATE_COLORS
        cv.box(x, y, 16, 10, fill=fill, stroke=stroke, pen=0.8)
        x += 20 + cv.text(x + 20, y - 2, "HSDP all-reduce over the replicate dimension", size=10)
    if any(i.op.is_collective for p in panels for i in p.timeline.intervals):
        cv.box(
            x,
            y,
            16,
            10,
            fill=f"{RED};0.2:#ffffff;0.2:{RED};0.2:#ffffff;0.2:{RED};0.2",
            style="striped",
            stroke=RED,
            pen=0.8,
        )
        x += 20 + cv.text(x + 20, y - 2, "exposed communication (compute not running)", size=10)
        x += 4 + cv.text(x + 4, y - 2, "plain: hidden behind compute", size=10)
