"""Hidden and exposed communication: Timeline -> per rank, how much collective time runs
while that rank's compute stream is busy with forward, backward or the optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from schedc.analysis.simulate import Interval, Timeline
from schedc.analysis.units import fmt_time
from schedc.ir.op import Kind, Op

COMPUTING = frozenset({Kind.FWD, Kind.BWD, Kind.RECOMPUTE, Kind.STEP})  # hides communication


@dataclass(frozen=True)
class Exposure:
    """One collective on one rank: its time split into hidden and exposed pieces."""

    interval: Interval
    segments: tuple[tuple[float, float, bool], ...]  # (start, end, hidden) covering it

    @property
    def hidden(self) -> float:
        return sum(e - s for s, e, h in self.segments if h)

    @property
    def exposed(self) -> float:
        return self.interval.length - self.hidden


@dataclass(frozen=True)
class Overlap:
    """A rank's communication: total, hidden behind compute, exposed; and its step time."""

    rank: int
    step: float
    items: tuple[Exposure, ...] = field(default=())

    @property
    def comm(self) -> float:
        return sum(x.interval.length for x in self.items)

    @property
    def hidden(self) -> float:
        return sum(x.hidden for x in self.items)

    @property
    def exposed(self) -> float:
        return sum(x.exposed for x in self.items)

    def of(self, op: Op | str) -> Exposure:
        op = Op.parse(op) if isinstance(op, str) else op
        return next(x for x in self.items if x.interval.op == op)

    def describe(self) -> str:
        if not self.items:
            return f"step {fmt_time(self.step)}; no communication"
        pct = 100 * self.hidden / self.comm if self.comm > 0 else 0.0
        return (
            f"step {fmt_time(self.step)}; communication {fmt_time(self.comm)}: "
            f"{fmt_time(self.hidden)} hidden behind compute ({pct:.0f}%), "
            f"{fmt_time(self.exposed)} exposed"
        )


def busy(intervals: list[Interval]) -> list[tuple[float, float]]:
    """The union of the intervals, as sorted disjoint (start, end) pairs."""
    out: list[list[float]] = []
    for i in sorted(intervals, key=lambda i: (i.start, i.end)):
        if out and i.start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], i.end)
        else:
            out.append([i.start, i.end])
    return [(s, e) for s, e in out]


def split(start: float, end: float, cover: list[tuple[float, float]]):
    """[start, end) cut into (s, e, covered) pieces by a sorted disjoint cover."""
    pieces, t = [], start
    for s, e in cover:
        if e <= t or s >= end:
            continue
        if s > t:
            pieces.append((t, s, False))
        pieces.append((max(s, t), min(e, end), True))
        t = min(e, end)
    if t < end:
        pieces.append((t, end, False))
    return tuple(pieces)


def overlap(tl: Timeline) -> dict[int, Overlap]:
    """Per rank: a collective is hidden where the rank's compute stream is busy computing.

    Computing means forward, backward and the optimizer step: a free is bookkeeping, and a
    collective placed on the compute stream blocks it, hiding nothing.
    """
    out = {}
    for r in tl.ranks:
        mine = [i for i in tl.intervals if i.rank == r]
        cover = busy([i for i in mine if i.stream == tl.compute_stream and i.op.kind in COMPUTING])
        items = tuple(Exposure(i, split(i.start, i.end, cover)) for i in mine if i.op.is_collective)
        t0 = min((i.start for i in mine), default=0.0)
        out[r] = Overlap(r, max((i.end for i in mine), default=0.0) - t0, items)
    return out
