"""The collectives' links fitted by `schedc calibrate` (analysis/calibrate.py): t = latency +
volume / bandwidth, volume = ring factor x bytes. All-reduces set the link within a node
(every collective together when there are none), all-gathers and reduce-scatters their own
(gather_*, scatter_*), and collectives whose group spans nodes the link across them.

    fit_comm(spec, base, points, notes) -> CommFit
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from schedc.analysis.cost import CostModel
from schedc.analysis.least_squares import line, rms, through_origin
from schedc.ir.op import Kind
from schedc.ir.spec import Spec

Point = tuple[float, float]  # (volume, seconds) of a collective


@dataclass(frozen=True)
class CommPoints:
    """One point per distinct collective: within one node (also by kind), across nodes."""

    within: list[Point]
    across: list[Point]
    kinds: dict[Kind, list[Point]]  # within a node, by kind


@dataclass(frozen=True)
class CommFit:
    """t = latency + volume / bandwidth: the all-reduce's link, the other kinds' own
    (`per_kind`: gather_* and scatter_*), and the link across nodes (`inter`, None when no
    collective's group spans nodes)."""

    bandwidth: float
    latency: float
    per_kind: dict[str, float]
    inter: float | None
    n: int
    inter_n: int
    rms: float
    mean: float
    measured: frozenset[str]


def fit_comm(spec: Spec, base: CostModel, points: CommPoints, notes: list[str]) -> CommFit:
    """Every link the points measure; what they cannot is `base`'s, with a note."""
    bandwidth, latency = base.bandwidth, base.latency
    per_kind: dict[str, float] = {}
    if points.within:
        bandwidth, latency, per_kind = _fit_within(spec, base, points, notes)
    inter: float | None = None
    across: list[float] = []  # residuals
    if points.across:  # a group across nodes (HSDP's replicate groups, or a flat world)
        inter, lat = _fit_link(
            points.across, base.inter_bandwidth or base.bandwidth, latency, notes, spec
        )
        if not points.within:
            latency = lat
            notes.append("no collective within one node: the intra-node bandwidth is kept")
        across = [t - latency - x / inter for x, t in points.across]
    every = points.within + points.across
    error, mean = 0.0, 0.0
    if every:
        priced = replace(base, bandwidth=bandwidth, latency=latency, **per_kind)
        within = [
            t - priced.link_of(kind)[0] - x / priced.link_of(kind)[1]
            for kind, xs in points.kinds.items()
            for x, t in xs
        ]
        error, mean = rms(within + across), sum(t for _, t in every) / len(every)
    else:
        notes.append("no collective spans: bandwidth and latency kept")
    measured = set(per_kind) | ({"inter_bandwidth"} if points.across else set())
    measured |= {"bandwidth", "latency"} if Kind.ALLREDUCE in points.kinds else set()
    n, inter_n = len(every), len(points.across)
    return CommFit(
        bandwidth, latency, per_kind, inter, n, inter_n, error, mean, frozenset(measured)
    )


def _fit_within(
    spec: Spec, base: CostModel, points: CommPoints, notes: list[str]
) -> tuple[float, float, dict[str, float]]:
    """The link within a node, set by the all-reduces (every collective together when there
    are none), and each other kind's own, where the trace has it."""
    kinds = points.kinds
    first = kinds.get(Kind.ALLREDUCE) or points.within
    bandwidth, latency = _fit_link(first, base.bandwidth, base.latency, notes, spec)
    per_kind: dict[str, float] = {}
    for kind, what in ((Kind.ALLGATHER, "gather"), (Kind.REDUCESCATTER, "scatter")):
        if kind in kinds:
            bw, lat = _fit_link(kinds[kind], bandwidth, latency, notes, spec, kind.value)
            per_kind |= {f"{what}_bandwidth": bw, f"{what}_latency": lat}
        elif Kind.ALLREDUCE in kinds:
            notes.append(
                f"no {kind.value} in the trace: {kind.value}s keep "
                + (
                    f"the given {what}_* parameters"
                    if getattr(base, f"{what}_bandwidth") is not None
                    else "the all-reduce's latency and bandwidth"
                )
            )
    if Kind.ALLREDUCE not in kinds and kinds:
        notes.append(
            "no all-reduce in the trace: bandwidth and latency (what all-reduces take) "
            "are fitted to every collective together"
        )
    return bandwidth, latency, per_kind


def _fit_link(
    coll: list[Point],
    bandwidth: float,
    latency: float,
    notes: list[str],
    spec: Spec,
    what: str = "",
) -> tuple[float, float]:
    """t = latency + volume / bandwidth by least squares over one link's collectives (or one
    kind's: `what` names it in the notes)."""
    notes_before = len(notes)
    fit = _fit_line(coll, bandwidth, latency, notes, spec)
    if what:
        notes[notes_before:] = [f"{what}: {n}" for n in notes[notes_before:]]
    return fit


def _fit_line(
    coll: list[Point], bandwidth: float, latency: float, notes: list[str], spec: Spec
) -> tuple[float, float]:
    """(bandwidth, latency) of the best line through `coll`, or what is kept, with a note."""
    a, b = line(coll)
    if b is None and all(x == 0 for x, _ in coll):
        notes.append(
            f"world {spec.world}: collectives move no data, so only their "
            "latency is measured; bandwidth kept"
        )
        return bandwidth, sum(t for _, t in coll) / len(coll)
    if b is None:
        notes.append(
            "every collective moves the same volume: latency fixed at 0 "
            "and bandwidth fitted through the origin"
        )
        a, b = 0.0, through_origin(coll)
    elif a < 0:
        notes.append("the best line has negative latency: latency fixed at 0")
        a, b = 0.0, through_origin(coll)
    if b > 0:
        return 1.0 / b, a
    notes.append("collective time does not grow with bytes: bandwidth kept, latency is the mean")
    return bandwidth, sum(t for _, t in coll) / len(coll)
