"""The timeline's drawing surface: fixed-position DOT nodes (`Canvas`, for `neato -n2`), the
time window drawn and its scale (`View`, `window_of`), and the geometry and palette every
part of the picture shares. Points throughout, y growing downward."""

from __future__ import annotations

from dataclasses import dataclass

from schedc.analysis.simulate import Timeline
from schedc.analysis.units import parse_time
from schedc.ir.op import Kind
from schedc.viz.dot import FONT, attrs, q

WIDTH = 1400.0  # points of time axis
LEFT = 92.0  # lane labels
LANE = 34.0
NOTE = 13.0  # the hidden/exposed row under a comm lane
ROW = 13.0  # one row of the gathered-units lane
EXPOSED = {Kind.ALLREDUCE: "#ff8787", Kind.REDUCESCATTER: "#ff8787", Kind.ALLGATHER: "#74c0fc"}
GREEN, RED, GREY, INK = "#2f9e44", "#e03131", "#868e96", "#1e1e1e"


def text_width(text: str, size: float) -> float:
    return max(len(line) for line in text.split("\n")) * size * 0.56


def fits(label: str, w: float, size: float) -> bool:
    """Whether `label` in type of `size` fits a box `w` points wide."""
    return text_width(label, size) <= w - 4


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


@dataclass(frozen=True)
class View:
    """The time window drawn, and points per second (one scale for every panel)."""

    t0: float
    t1: float
    scale: float

    def x(self, t: float) -> float:
        return LEFT + (t - self.t0) * self.scale

    def clip(self, start: float, end: float) -> tuple[float, float] | None:
        """The part of [start, end] in the window; None if it is outside."""
        s, e = max(start, self.t0), min(end, self.t1)
        return (s, e) if e > s or (start == end and self.t0 <= start <= self.t1) else None

    def clamp(self, start: float, end: float) -> tuple[float, float]:
        """[start, end] cut to the window: `clip` of a span known to be in it."""
        return max(start, self.t0), min(end, self.t1)


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
        return parse_time(text)

    t0, t1 = at(a, False), at(b, True)
    if not t1 > t0:
        raise ValueError(f"window {spec!r} is empty")
    return t0, t1
