"""One rank's lanes drawn: each box on its stream's lane (a collective's hidden pieces
plain, its exposed pieces striped), the hidden/exposed words or the marks under a comm
lane, the micro-step markers above compute, and FSDP's gathered-units lane."""

from __future__ import annotations

import math
from collections.abc import Iterable

from schedc.analysis.overlap import Exposure, Overlap
from schedc.analysis.simulate import Timeline
from schedc.analysis.units import fmt_time
from schedc.ir.op import Kind, Op
from schedc.ir.spec import Spec
from schedc.viz.dot import colors_of
from schedc.viz.timeline.boxes import Box, box_width
from schedc.viz.timeline.canvas import (
    EXPOSED,
    GREEN,
    GREY,
    INK,
    LEFT,
    RED,
    ROW,
    Canvas,
    View,
    fits,
    text_width,
)


def draw_box(
    cv: Canvas,
    b: Box,
    name: tuple[str, float],
    ov: Overlap,
    v: View,
    y: float,
    h: float,
    spec: Spec,
) -> None:
    """A box on its lane, labelled `name` (label, font size); a free too short to see is a
    tick standing out of the lane."""
    label, size = name
    x0 = v.x(v.clamp(b.start, b.end)[0])
    w = box_width(b, v)
    fill, stroke = colors_of(spec, b.op)
    if b.op.kind is Kind.FREE and w < 3:  # a free takes ~1 us: a tick, so it can be seen,
        # standing out of the lane's boxes above and below
        cv.box(x0 - 0.8, y - 3, 1.6, h + 6, fill="#495057", tooltip=b.tooltip(), cls="free")
        return
    if not b.op.is_collective:
        style = "filled,dashed" if b.op.kind is Kind.FREE else "filled"
        cv.box(
            x0,
            y,
            w,
            h,
            fill=fill,
            stroke=stroke,
            label=label,
            size=size,
            tooltip=b.tooltip(),
            style=style,
            pen=0.8 if w >= 4 else 0.3,
        )
        return
    _collective_fill(cv, b, fill, ov, v, y, h)
    cv.box(
        x0,
        y,
        w,
        h,
        stroke=stroke,
        label=label,
        size=size,
        tooltip=b.tooltip(),
        pen=1.2 if w >= 6 else 0.4,
        style="solid",
    )


def _collective_fill(
    cv: Canvas, b: Box, fill: str, ov: Overlap, v: View, y: float, h: float
) -> None:
    """A collective's time, piece by piece: hidden pieces filled plain, exposed ones striped."""
    mine = next((x for x in ov.items if x.interval.op == b.op), None)
    segments = mine.segments if mine else ((b.start, b.end, True),)
    for s, e, hidden in segments:
        clipped = v.clip(s, e)
        if clipped is None:
            continue
        sx, ex = v.x(clipped[0]), v.x(clipped[1])
        if hidden:
            cv.box(sx, y, ex - sx, h, fill=fill)
        else:
            n = max(1, round((ex - sx) / 3.0))
            n += (n + 1) % 2  # odd: a stripe of colour at both ends
            stripes = ":".join(
                f"{EXPOSED[b.op.kind] if i % 2 == 0 else '#ffffff'};{1 / n:.4f}" for i in range(n)
            )
            cv.box(sx, y, ex - sx, h, fill=stripes, style="striped", stroke="none", pen=0)


def _ranges(numbers: list[int]) -> str:
    """[3, 4, 5, 7] -> "3..5,7"."""
    out: list[tuple[int, int]] = []
    for n in sorted(numbers):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return ",".join(f"{a}" if a == b else f"{a},{b}" if b == a + 1 else f"{a}..{b}" for a, b in out)


def mark_row(cv: Canvas, marked: list[Box], marks: dict[Op, int], v: View, y: float) -> float:
    """Under a lane: a tick under each marked collective and its number; numbers that would
    collide share one text (`3..13`), but each op keeps its own tick and its own table row."""
    groups: list[tuple[float, float, list[int]]] = []  # (first x, last x, numbers)
    for b in sorted(marked, key=lambda b: b.start):
        start, end = v.clamp(b.start, b.end)
        x = (v.x(start) + v.x(end)) / 2
        cv.box(x - 0.4, y - 1, 0.8, 4, fill=INK, cls="mark")
        groups.append((x, x, [marks[b.op]]))
        while len(groups) > 1:  # merge into the group before while their texts would touch
            (a, z, ns), (a2, z2, ns2) = groups[-2], groups[-1]
            if (a2 + z2) / 2 - text_width(_ranges(ns2), 8) / 2 >= (a + z) / 2 + text_width(
                _ranges(ns), 8
            ) / 2 + 3:
                break
            groups[-2:] = [(a, z2, ns + ns2)]
    for a, z, ns in groups:
        cv.text((a + z) / 2, y + 2, _ranges(ns), size=8, align="c", bold=True, cls="mark")
    return y + 14


def notes(cv: Canvas, items: Iterable[Exposure], v: View, y: float) -> None:
    """Under each collective: hidden, exposed <time>, or the hidden share; where room is."""
    free_from = -math.inf
    for x in sorted(items, key=lambda x: x.interval.start):
        iv = x.interval
        clipped = v.clip(iv.start, iv.end)
        if iv.length <= 0 or clipped is None:
            continue
        a, b = clipped
        text, color = _status(x)
        centre = (v.x(a) + v.x(b)) / 2
        w = text_width(text, 9)
        if centre - w / 2 >= free_from + 4 and w <= v.x(b) - v.x(a) + 60:
            cv.text(centre, y - 1, text, size=9, color=color, align="c")
            free_from = centre + w / 2


def markers(cv: Canvas, tl: Timeline, r: int, y: float, v: View) -> float:
    """mb0, mb1, ... above the compute lane, at each micro-step's first forward op."""
    if tl.spec.accum == 1:
        return y
    firsts: dict[int, float] = {}
    for iv in tl.on(r, tl.compute_stream):
        if iv.op.kind is Kind.FWD and iv.op.mb not in firsts:
            firsts[iv.op.mb] = iv.start
    free_from = -math.inf
    for mb, t in sorted(firsts.items()):
        if not v.t0 <= t < v.t1:
            continue
        x = v.x(t)
        if x >= free_from + 3:
            free_from = x + cv.text(x - 3, y, f"mb{mb}", size=9, color=GREY)
    return y + 13


def gathered(cv: Canvas, tl: Timeline, r: int, v: View, y: float, width: float) -> float:
    """Each unit's full parameters, from the start of its all-gather to the end of its free."""
    spans: list[tuple[float, float, str]] = []
    open_at: dict[str, float] = {}
    for iv in sorted((i for i in tl.intervals if i.rank == r), key=lambda i: (i.start, i.end)):
        if iv.op.kind is Kind.ALLGATHER and iv.op.target not in open_at:
            open_at[iv.op.target] = iv.start
        elif iv.op.kind is Kind.FREE and iv.op.target in open_at:
            spans.append((open_at.pop(iv.op.target), iv.end, iv.op.target))
    spans += [(s, tl.end, u) for u, s in open_at.items()]
    rows: list[float] = []
    placed = []
    for s, e, u in sorted(spans):
        row = next((k for k, end in enumerate(rows) if end <= s), None)
        if row is None:
            rows.append(e)
            row = len(rows) - 1
        rows[row] = e
        placed.append((s, e, u, row))
    height = max(len(rows), 1) * ROW + 4
    cv.box(LEFT, y, width, height, fill="#fcfcfd", stroke="#e9ecef")
    who = f"rank {r}\n" if len(tl.ranks) > 1 else ""
    cv.text(
        LEFT - 8, y + height / 2 - (15 if who else 8), f"{who}gathered\nparams", size=10, align="r"
    )
    for start, end, u, row in placed:
        clipped = v.clip(start, end)
        if clipped is None:
            continue
        s, e = clipped
        w = v.x(e) - v.x(s)
        label = next((t for t in (f"{u} full", u) if fits(t, w, 9)), "")
        cv.box(
            v.x(s),
            y + 2 + row * ROW,
            w,
            ROW - 2,
            fill="#dee2e6",
            stroke="#868e96",
            label=label,
            size=9,
            font="#495057",
            pen=0.6,
            tooltip=f"{u} gathered: {fmt_time(e - s)}",
        )
    return y + height + 2


def _status(x: Exposure) -> tuple[str, str]:
    """A collective's hidden/exposed split as words, and their colour."""
    share = x.hidden / x.interval.length if x.interval.length > 0 else 1.0
    if share >= 0.99:
        return "hidden", GREEN
    if share <= 0.01:
        return f"exposed {fmt_time(x.exposed)}", RED
    return f"{100 * share:.0f}% hidden, {fmt_time(x.exposed)} exposed", "#e8590c"
