"""The timeline view, in the seed pictures' style, as DOT for `neato -n2` (fixed positions).

Per rank one lane per stream (compute, comm), time left to right on one scale shared by
every panel; a box per op whose width is its duration. Consecutive forward (or backward)
ops of one micro-step that no event separates are drawn as one box (`bwd[h.1 .. embed]@mb3`)
unless --unfold; for FSDP a "gathered" lane shows each unit from its all-gather to its free.
A collective's time is split where the rank's compute stream is computing: hidden pieces
are drawn plain, exposed pieces striped, and the caption totals both per rank.

    panels_for(compiled, cost, ...) -> [Panel]    predicted (simulated) and/or measured
    timeline_dot(panels)             -> DOT text
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from schedc.analysis.cost import CostModel
from schedc.analysis.overlap import Overlap, overlap
from schedc.analysis.simulate import Interval, Timeline, simulate
from schedc.analysis.trace.compare import measured
from schedc.analysis.trace.schema import Trace
from schedc.analysis.units import fmt_time
from schedc.compiler import Compiled
from schedc.ir.op import Kind, Op
from schedc.ir.plan import Action
from schedc.ir.spec import Strategy
from schedc.viz.dot import COLORS, FONT, REPLICATE_COLORS, attrs, colors_of, q
from schedc.viz.graph import describe

WIDTH = 1400.0  # points of time axis
LEFT = 92.0  # lane labels
LANE = 34.0
NOTE = 13.0  # the hidden/exposed row under a comm lane
ROW = 13.0  # one row of the gathered-units lane
EXPOSED = {Kind.ALLREDUCE: "#ff8787", Kind.REDUCESCATTER: "#ff8787", Kind.ALLGATHER: "#74c0fc"}
GREEN, RED, GREY, INK = "#2f9e44", "#e03131", "#868e96", "#1e1e1e"
ABBR = {Kind.ALLREDUCE: "AR", Kind.ALLGATHER: "AG", Kind.REDUCESCATTER: "RS"}


@dataclass
class Panel:
    """One timeline to draw: what it is, when each op ran, and its hidden/exposed split."""

    compiled: Compiled
    timeline: Timeline
    overlap: dict[int, Overlap]

    @classmethod
    def of(cls, compiled: Compiled, tl: Timeline) -> Panel:
        return cls(compiled, tl, overlap(tl))

    @property
    def name(self) -> str:
        return Path(self.compiled.source.path).name

    def subtitle(self) -> str:
        tl = self.timeline
        who = (
            f"rank {tl.ranks[0]} shown; every rank of {tl.spec.world} runs the same plan"
            if tl.every_rank
            else f"rank{'s' if len(tl.ranks) > 1 else ''} {', '.join(map(str, tl.ranks))}"
        )
        return f"{tl.source} ({tl.note}); {who}"

    def report(self) -> list[str]:
        head = f"{self.name}, {self.timeline.source}:"
        who = "every rank" if self.timeline.every_rank else "rank {}"
        return [f"{head} {who.format(r)}: {ov.describe()}" for r, ov in self.overlap.items()]


def panels_for(
    compiled: list[Compiled],
    cost: CostModel,
    *,
    rank: int | None = None,
    trace: Trace | None = None,
    trace_name: str = "trace",
    step: int | None = None,
    compare: bool = False,
    cost_note: str = "",
) -> list[Panel]:
    """The panels a timeline draws: predicted for each schedule, or the measured step of
    `trace` (with the prediction above it when `compare`); one rank, or all. `cost_note`
    says where the cost model came from, in the predicted panels' subtitles."""
    ranks = [rank] if rank is not None else None
    if trace is None:
        return [Panel.of(c, simulate(c, cost, ranks)) for c in compiled]
    c = compiled[0]
    tl = measured(c, trace, step, ranks, name=trace_name)
    panels = []
    if compare:
        predicted = simulate(c, cost, ranks)
        if cost_note:
            predicted = replace(predicted, note=f"{predicted.note}; {cost_note}")
        panels.append(Panel.of(c, predicted))
    return panels + [Panel.of(c, tl)]


# -- boxes: ops, or runs of layers that nothing else waits on ------------------------------------


@dataclass
class Box:
    items: list[Interval]

    @property
    def op(self) -> Op:
        return self.items[0].op

    @property
    def start(self) -> float:
        return self.items[0].start

    @property
    def key(self) -> tuple[Op, ...]:
        """What the box draws, the same on every rank that runs it: it is named once."""
        return tuple(i.op for i in self.items)

    @property
    def end(self) -> float:
        return self.items[-1].end

    def labels(self, spec) -> list[str]:
        """Candidate labels, longest first; the first that fits the box is drawn."""
        op, last = self.op, self.items[-1].op
        at = f" mb{op.mb}" if spec.accum > 1 else ""
        if len(self.items) > 1:
            k = op.kind.value
            unit = _unit_of(spec, [i.op.target for i in self.items])
            if unit:  # seed 004 reads "fwd U1"
                return [
                    f"{k} {unit}{at} ({op.target} .. {last.target})",
                    f"{k} {unit}{at}",
                    f"{k} {unit}",
                    k,
                ]
            return [
                f"{k}[{op.target} .. {last.target}]@mb{op.mb}",
                f"{k} {op.target}..{last.target}",
                *([f"{k}{at}"] if at else []),
                k,
            ]
        if op.is_collective:
            tail = f":{op.phase.value}" if op.phase else ""
            return [str(op), f"{ABBR[op.kind]} {op.target}{tail}", short(op)]
        if op.kind is Kind.STEP:
            return ["optimizer.step", "optimizer", "opt"]
        if op.kind is Kind.FREE:
            return [str(op), f"free {op.target}"]
        return [str(op), f"{op.kind.value} {op.target}", op.target]

    def tooltip(self) -> str:
        ops = str(self.op) if len(self.items) == 1 else f"{self.op} .. {self.items[-1].op}"
        return (
            f"{ops}: {fmt_time(self.end - self.start)} "
            f"({fmt_time(self.start)} .. {fmt_time(self.end)})"
        )


def short(op: Op) -> str:
    """A collective's shortest name, `AR b1`: what a mark's row in the table calls it."""
    return f"{ABBR[op.kind]} {op.target}"


def _unit_of(spec, layers: list[str]) -> str | None:
    """The FSDP unit (not kept gathered) whose layers these are, if there is one."""
    if spec.kind is not Strategy.FSDP:
        return None
    for u in spec.strategy.units:
        if not u.keep and set(layers) <= set(u.layers):
            return u.name
    return None


def boxes(c: Compiled, lane: list[Interval], rank: int, unfold: bool) -> list[Box]:
    """A lane's intervals as boxes: consecutive fwd (or bwd) ops of one micro-step join one
    box unless an event is recorded inside the run or waited for inside it."""
    plan = c.plan(rank)
    records = set(plan.producers.values())
    waits: set[Op] = set()
    pending: set[str] = set()
    for ins in plan.instrs:  # a wait belongs to the next run on its stream
        if ins.kind is Action.WAIT and ins.event != plan.step_start:
            pending.add(ins.stream)
        elif ins.kind is Action.RUN and ins.stream in pending:
            pending.discard(ins.stream)
            waits.add(ins.op)
    out: list[Box] = []
    for iv in lane:
        cur = out[-1] if out else None
        if (
            not unfold
            and cur is not None
            and iv.op.kind in (Kind.FWD, Kind.BWD)
            and cur.op.kind is iv.op.kind
            and cur.op.mb == iv.op.mb
            and cur.items[-1].op not in records
            and iv.op not in waits
        ):
            cur.items.append(iv)
        else:
            out.append(Box([iv]))
    return out


# -- the canvas ------------------------------------------------------------------------------------


def text_width(text: str, size: float) -> float:
    return max(len(line) for line in text.split("\n")) * size * 0.56


class Canvas:
    """Fixed-position nodes, y growing downward (flipped on output), in points."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.n = 0

    def _id(self) -> str:
        self.n += 1
        return f"n{self.n}"

    def box(
        self,
        x: float,
        y: float,
        w: float,
        h: float,
        *,
        fill: str | None = None,
        stroke: str = "none",
        label: str = "",
        size: float = 10,
        tooltip: str | None = None,
        style: str | None = None,
        cls: str | None = None,
        pen: float = 1.0,
        font: str = INK,
    ) -> None:
        if w <= 0.05 or h <= 0:
            return
        style = style or ("filled" if fill else "solid")
        self.lines.append(
            f"  {self._id()} "
            + attrs(
                pos=q(f"{x + w / 2:.2f},{-(y + h / 2):.2f}!"),
                width=f"{w / 72:.4f}",
                height=f"{h / 72:.4f}",
                label=q(label),
                style=q(style),
                fillcolor=q(fill) if fill else None,
                color=q(stroke),
                penwidth=f"{pen:g}",
                fontsize=f"{size:g}",
                fontcolor=q(font),
                tooltip=q(tooltip) if tooltip else None,
                **{"class": q(cls)} if cls else {},
            )
        )

    def text(
        self,
        x: float,
        y: float,
        text: str,
        *,
        size: float = 10,
        color: str = INK,
        align: str = "l",
        bold: bool = False,
        cls: str | None = None,
    ) -> float:
        """Text whose left (align l), centre (c) or right (r) edge is at x, top at y."""
        w = text_width(text, size) + 6
        h = size * 1.25 * (text.count("\n") + 1)
        cx = {"l": x + w / 2, "c": x, "r": x - w / 2}[align]
        end = {"l": "\\l", "c": "\n", "r": "\\r"}[align]
        label = end.join(text.split("\n")) + (end if align != "c" else "")
        self.lines.append(
            f"  {self._id()} "
            + attrs(
                pos=q(f"{cx:.2f},{-(y + h / 2):.2f}!"),
                width=f"{w / 72:.4f}",
                height=f"{h / 72:.4f}",
                label=q(label),
                shape="plaintext",
                fontsize=f"{size:g}",
                fontcolor=q(color),
                fontname=q(FONT + "-Bold" if bold else FONT),
                **{"class": q(cls)} if cls else {},
            )
        )
        return w

    def dot(self) -> str:
        head = [
            "// positions are pinned: draw with `neato -n2 -Tsvg THIS.dot -o OUT.svg`",
            "digraph timeline {",
            "  graph "
            + attrs(splines="false", outputorder="nodesfirst", bgcolor=q("white"), pad="0.2")
            + ";",
            f"  node {attrs(shape='box', fixedsize='true', fontname=q(FONT), margin='0')};",
        ]
        return "\n".join(head + self.lines + ["}"]) + "\n"


# -- layout ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """The time window drawn, and points per second (one scale for every panel)."""

    t0: float
    t1: float
    scale: float

    def x(self, t: float) -> float:
        return LEFT + (t - self.t0) * self.scale

    def clip(self, start: float, end: float) -> tuple[float, float] | None:
        s, e = max(start, self.t0), min(end, self.t1)
        return (s, e) if e > s or (start == end and self.t0 <= start <= self.t1) else None


def window_of(tl: Timeline, spec: str | None) -> tuple[float, float]:
    """`mb3:` (micro-step 3 to the end), `mb1:mb2`, `:mb0`, or times `70ms:90ms`; None: all."""
    if not spec:
        return 0.0, tl.end
    if ":" not in spec:
        spec = f"{spec}:{spec}"
    a, b = spec.split(":", 1)

    def at(text: str, end: bool) -> float:
        text = text.strip()
        if not text:
            return tl.end if end else 0.0
        if text.startswith("mb") and text[2:].isdigit():
            mine = [i for i in tl.intervals if i.op.mb == int(text[2:])]
            if not mine:
                raise ValueError(
                    f"no micro-step {text} in this step (it has mb0..mb{tl.spec.accum - 1})"
                )
            return max(i.end for i in mine) if end else min(i.start for i in mine)
        from schedc.analysis.units import parse_time

        return parse_time(text)

    t0, t1 = at(a, False), at(b, True)
    if not t1 > t0:
        raise ValueError(f"window {spec!r} is empty")
    return t0, t1


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
    _legend(cv, y, panels)
    return cv.dot()


def _fits(label: str, w: float, size: float) -> bool:
    return text_width(label, size) <= w - 4


def _panel(cv: Canvas, p: Panel, y: float, v: View, width: float, unfold: bool) -> float:
    tl, c = p.timeline, p.compiled
    cv.text(0, y, f"{p.name}: {describe(c)}", size=14, bold=True)
    y += 20
    cv.text(0, y, p.subtitle(), size=10, color="#495057")
    y += 20
    lanes = {
        (r, s): [b for b in boxes(c, tl.on(r, s), r, unfold) if v.clip(b.start, b.end)]
        for r in tl.ranks
        for s in tl.streams
    }
    names = _names(tl.spec, lanes, v)
    marks = _marks(lanes, names)
    for r in tl.ranks:
        y = _markers(cv, tl, r, y, v)
        for s in tl.streams:
            cv.box(LEFT, y, width, LANE, fill="#f8f9fa", stroke="#e9ecef")
            who = f"rank {r}\n" if len(tl.ranks) > 1 else ""
            cv.text(
                LEFT - 8, y + LANE / 2 - (15 if who else 8), f"{who}{s}\nstream", size=10, align="r"
            )
            lane = lanes[(r, s)]
            # frees last: a free's tick lies on the edge of the boxes around it
            for b in sorted(lane, key=lambda b: b.op.kind is Kind.FREE):
                _draw_box(cv, b, names[b.key], p.overlap[r], v, y + 3, LANE - 6, tl.spec)
            y += LANE + 2
            if any(b.op.is_collective and b.op not in marks for b in lane):
                mine = [x for x in p.overlap[r].items if x.interval.stream == s]
                _notes(cv, [x for x in mine if x.interval.op not in marks], v, y)
                y += NOTE
            if any(b.op in marks for b in lane):
                y = _mark_row(cv, [b for b in lane if b.op in marks], marks, v, y)
        if tl.spec.kind is Strategy.FSDP:
            y = _gathered(cv, tl, r, v, y, width)
        y += 6
    y = _axis(cv, y + 4, v, width)
    lines = _caption(p)
    if v.t0 > 0 or v.t1 < tl.end:
        lines.append(
            f"drawn: {fmt_time(v.t0)} .. {fmt_time(v.t1)} of the {fmt_time(tl.end)} "
            "step (--window); the totals above are for the whole step"
        )
    for line in lines:
        cv.text(0, y, line, size=11)
        y += 15
    return _table(cv, p, marks, y, LEFT + width)


def _width(b: Box, v: View) -> float:
    """The drawn width of a box, in points (a zero-length op is still a hairline)."""
    start, end = v.clip(b.start, b.end)
    return max(v.x(end) - v.x(start), 0.8)


def _names(
    spec, lanes: dict[tuple[int, str], list[Box]], v: View
) -> dict[tuple, tuple[str, float]]:
    """One label per op (or run of ops) for every rank, and its font size: the longest
    candidate that fits its narrowest box on any rank, else the shortest in smaller type;
    "" where none fits (a collective then gets a mark)."""
    narrowest: dict[tuple, tuple[float, Box]] = {}
    for lane in lanes.values():
        for b in lane:
            w = _width(b, v)
            if b.key not in narrowest or w < narrowest[b.key][0]:
                narrowest[b.key] = (w, b)
    out = {}
    for k, (w, b) in narrowest.items():
        tries = [(t, 10.0) for t in b.labels(spec)] + [(b.labels(spec)[-1], 8.0)]
        out[k] = next(((t, size) for t, size in tries if _fits(t, w, size)), ("", 10.0))
    return out


def _marks(lanes: dict[tuple[int, str], list[Box]], names: dict[tuple, tuple]) -> dict[Op, int]:
    """Collectives too narrow for any label, numbered 1, 2, ... by when they first start;
    the number marks the op under its box on every rank and keys its row of the table."""
    first: dict[Op, float] = {}
    for lane in lanes.values():
        for b in lane:
            if b.op.is_collective and not names[b.key][0]:
                first[b.op] = min(first.get(b.op, math.inf), b.start)
    ordered = sorted(first, key=lambda op: (first[op], str(op)))
    return {op: n for n, op in enumerate(ordered, 1)}


def _ranges(numbers: list[int]) -> str:
    """[3, 4, 5, 7] -> "3..5,7"."""
    out: list[tuple[int, int]] = []
    for n in sorted(numbers):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return ",".join(f"{a}" if a == b else f"{a},{b}" if b == a + 1 else f"{a}..{b}" for a, b in out)


def _mark_row(cv: Canvas, marked: list[Box], marks: dict[Op, int], v: View, y: float) -> float:
    """Under a lane: a tick under each marked collective and its number; numbers that would
    collide share one text (`3..13`), but each op keeps its own tick and its own table row."""
    groups: list[tuple[float, float, list[int]]] = []  # (first x, last x, numbers)
    for b in sorted(marked, key=lambda b: b.start):
        start, end = v.clip(b.start, b.end)
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


def _status(x) -> tuple[str, str]:
    """A collective's hidden/exposed split as words, and their colour."""
    share = x.hidden / x.interval.length if x.interval.length > 0 else 1.0
    if share >= 0.99:
        return "hidden", GREEN
    if share <= 0.01:
        return f"exposed {fmt_time(x.exposed)}", RED
    return f"{100 * share:.0f}% hidden, {fmt_time(x.exposed)} exposed", "#e8590c"


def _share(x) -> str:
    """`hidden`, `exposed`, or `40% hidden`: the words of a table row."""
    share = x.hidden / x.interval.length if x.interval.length > 0 else 1.0
    if share >= 0.99:
        return "hidden"
    return "exposed" if share <= 0.01 else f"{100 * share:.0f}% hidden"


def _table(cv: Canvas, p: Panel, marks: dict[Op, int], y: float, right: float) -> float:
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
            x = next((x for x in ov.items if x.interval.op == op), None)
            if x is not None:
                who = "" if len(p.overlap) == 1 else f"rank {r} "
                per.append(f"{who}{fmt_time(x.interval.length)}, {_share(x)}")
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


def _draw_box(
    cv: Canvas, b: Box, name: tuple[str, float], ov: Overlap, v: View, y: float, h: float, spec
) -> None:
    label, size = name
    start, end = v.clip(b.start, b.end)
    x0 = v.x(start)
    w = _width(b, v)
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
    mine = next((x for x in ov.items if x.interval.op == b.op), None)
    segments = mine.segments if mine else ((b.start, b.end, True),)
    for s, e, hidden in segments:
        if v.clip(s, e) is None:
            continue
        s, e = v.clip(s, e)
        sx, ex = v.x(s), v.x(e)
        if hidden:
            cv.box(sx, y, ex - sx, h, fill=fill)
        else:
            n = max(1, round((ex - sx) / 3.0))
            n += (n + 1) % 2  # odd: a stripe of colour at both ends
            stripes = ":".join(
                f"{EXPOSED[b.op.kind] if i % 2 == 0 else '#ffffff'};{1 / n:.4f}" for i in range(n)
            )
            cv.box(sx, y, ex - sx, h, fill=stripes, style="striped", stroke="none", pen=0)
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


def _notes(cv: Canvas, items, v: View, y: float) -> None:
    """Under each collective: hidden, exposed <time>, or the hidden share; where room is."""
    free_from = -math.inf
    for x in sorted(items, key=lambda x: x.interval.start):
        iv = x.interval
        if iv.length <= 0 or v.clip(iv.start, iv.end) is None:
            continue
        a, b = v.clip(iv.start, iv.end)
        text, color = _status(x)
        centre = (v.x(a) + v.x(b)) / 2
        w = text_width(text, 9)
        if centre - w / 2 >= free_from + 4 and w <= v.x(b) - v.x(a) + 60:
            cv.text(centre, y - 1, text, size=9, color=color, align="c")
            free_from = centre + w / 2


def _markers(cv: Canvas, tl: Timeline, r: int, y: float, v: View) -> float:
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


def _gathered(cv: Canvas, tl: Timeline, r: int, v: View, y: float, width: float) -> float:
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
    for s, e, u, row in placed:
        if v.clip(s, e) is None:
            continue
        s, e = v.clip(s, e)
        w = v.x(e) - v.x(s)
        label = next((t for t in (f"{u} full", u) if _fits(t, w, 9)), "")
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


def _axis(cv: Canvas, y: float, v: View, width: float) -> float:
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


def _caption(p: Panel) -> list[str]:
    out = []
    for r, ov in p.overlap.items():
        who = "every rank" if p.timeline.every_rank else f"rank {r}"
        out.append(f"{who}: {ov.describe()}")
    return out


def _legend(cv: Canvas, y: float, panels: list[Panel]) -> None:
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
        if k is Kind.FREE:  # drawn as a tick (see _draw_box)
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
