"""The cost model fitted to a measured trace: `schedc calibrate`, and the refit of `schedc
tune --measure`.

    calibrate(compiled, trace)  -> Fit    compute throughput from fwd/bwd spans, bandwidth and
                                          latency from collectives, memory bandwidth from the
                                          optimizer step

The fit is a few named steps: the spans fitted (`_spans_to_fit`); each term's points, the
measured ops paired with what the schedule says they compute or move (`_compute_points`,
`_comm_points`); each term fitted (`_fit_compute`, the links' `fit_comm` of
analysis/links.py, `_fit_memory`); the model they make (`_fitted_model`). `Fit.report` says
what came of it. The probes `schedc run --trace --probe` adds are read by
analysis/probes.py, the least squares solved by analysis/least_squares.py. Nothing here
imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from statistics import median

from schedc.analysis.cost import (
    MAY_BE_ZERO,
    CostModel,
    comm_volume,
    compute_time,
    grad_bytes,
    op_flops,
    optimizer_bytes,
    spans_nodes,
)
from schedc.analysis.least_squares import nnls, rms
from schedc.analysis.links import CommFit, CommPoints, fit_comm
from schedc.analysis.probes import compute_probes, probes
from schedc.analysis.trace.compare import against
from schedc.analysis.trace.schema import Trace, TracedOp, TraceError
from schedc.analysis.units import fmt_rate, fmt_time
from schedc.compiler import Compiled
from schedc.ir.op import Kind, Op
from schedc.ir.spec import Spec

# -- the fit ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    """What `calibrate` found: the fitted cost model, how well each term explains the trace
    (points, rms residual, mean time), and notes on what it could not fit."""

    cost: CostModel
    compute_n: int  # distinct fwd/bwd ops, each the median of its spans
    compute_rms: float  # seconds, residual of t = flops / F
    compute_mean: float
    comm_n: int
    comm_rms: float  # seconds, residual of t = latency + volume / bandwidth
    comm_mean: float
    notes: tuple[str, ...]
    compute_key: str = "flops_tf32"  # the rate fitted: the traced schedule's compute dtype's
    inter_n: int = 0  # of comm_n, the collectives whose group spans nodes
    measured: frozenset[str] = frozenset()
    """The parameters this trace measured directly (not kept from `base`, not stood in
    for: an FSDP trace's `bandwidth` is fitted to its all-gathers and reduce-scatters, no
    all-reduce's). Merging fits (`tune --measure`'s refit) prefers these."""

    def report(self) -> str:
        c = self.cost

        def err(error, mean):
            return (
                f"rms error {fmt_time(error)} ({100 * error / mean:.1f}% of the mean)"
                if mean
                else "no spans"
            )

        lines = [
            (
                f"compute     {fmt_rate(getattr(c, self.compute_key), 'FLOP/s')} "
                f"({self.compute_key})   from {self.compute_n} distinct "
                f"fwd/bwd ops, {err(self.compute_rms, self.compute_mean)}"
            ),
            f"overhead    {fmt_time(c.overhead)} per fwd/bwd op",
            "gradients   "
            + (
                f"{fmt_rate(c.grad_bandwidth, 'B/s')} (a backward's parameter gradient bytes)"
                if c.grad_bandwidth
                else "no term (grad_bandwidth unset)"
            ),
            f"bandwidth   {fmt_rate(c.bandwidth, 'B/s')} (bus"
            + (
                f", within a node of {c.node_size:g}); across nodes "
                f"{fmt_rate(c.inter_bandwidth, 'B/s')} from {self.inter_n} of them"
                if self.inter_n and c.inter_bandwidth
                else ")"
            ),
            (
                f"latency     {fmt_time(c.latency)}   bandwidth and latency from {self.comm_n} "
                f"distinct collectives, {err(self.comm_rms, self.comm_mean)}"
            ),
            *(
                f"{what:<11} {fmt_rate(bw, 'B/s')} bus, {fmt_time(lat)} latency ({kind}s)"
                for what, kind, bw, lat in (
                    # unset, a kind's latency is the all-reduce's (CostModel.link_of)
                    ("gather", "all-gather", c.gather_bandwidth, c.link_of(Kind.ALLGATHER)[0]),
                    (
                        "scatter",
                        "reduce-scatter",
                        c.scatter_bandwidth,
                        c.link_of(Kind.REDUCESCATTER)[0],
                    ),
                )
                if bw is not None
            ),
            f"memory      {fmt_rate(c.mem_bandwidth, 'B/s')} (optimizer step)",
            f"free        {fmt_time(c.free)}",
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def calibrate(
    compiled: Compiled, trace: Trace, base: CostModel | None = None, name: str = "trace"
) -> Fit:
    """Least squares over the ops of the trace, skipping step 0 (warm-up) if there are more.

    Each distinct op (`bwd[h.3]`, `allreduce[b1]`, ...) is one point: the median of its
    durations over micro-steps, steps and ranks, so that an op the OS preempted on a busy
    machine does not pull the fit.
    compute:     t = overhead + flops(op) / F + grad_bytes(op) / G by non-negative least
                 squares (each of overhead and 1/G dropped when its best value would be
                 negative; no G term: grad_bandwidth unset); F is the rate of the
                 schedule's compute dtype (flops_bf16, flops_tf32 or flops_fp32), the
                 others keep `base`'s values
    collectives: t = latency + volume(op) / bandwidth, volume = ring factor x bytes, and
                 t from the last rank's arrival to the last rank's completion; fitted per
                 kind: all-reduces give latency and bandwidth (every collective together
                 when the trace has no all-reduce), all-gathers gather_*, reduce-scatters
                 scatter_*; a kind the schedule's ops lack is fitted to the trace's probe
                 (`schedc run --probe`) if it has one, else keeps `base`'s (unset: the
                 all-reduce's)
    optimizer:   mem_bandwidth = bytes / t, AdamW's and the norm's and clipping's bytes (so
                 norm_bandwidth is set to it: the same memory-bound passes);   free: t
    What a trace cannot determine keeps `base`'s value, with a note.
    """
    spec, base = compiled.spec, base or CostModel()
    used = _spans_to_fit(compiled, trace, name)
    notes: list[str] = []  # in the order the steps find them
    compute = _fit_compute(spec, base, _compute_points(spec, used, trace, name, notes), notes)
    comm = fit_comm(spec, base, _comm_points(spec, base, used, trace, name, notes), notes)
    memory = _fit_memory(spec, base, used)
    cost = _fitted_model(base, compute, comm, memory, notes)
    return Fit(
        cost,
        compute.n,
        compute.rms,
        compute.mean,
        comm.n,
        comm.rms,
        comm.mean,
        tuple(notes),
        compute.key,
        comm.inter_n,
        compute.measured | comm.measured | memory.measured,
    )


# -- the steps of the fit --------------------------------------------------------------------------


@dataclass(frozen=True)
class _ComputeFit:
    """t = overhead + flops / rate + gradient bytes / grad_bandwidth, over `n` points."""

    key: str  # the rate fitted: the schedule's compute dtype's (CostModel.rate_key)
    rate: float
    overhead: float
    grad_bandwidth: float | None
    n: int = 0
    rms: float = 0.0
    mean: float = 0.0

    def values(self) -> dict[str, float | None]:
        return {
            self.key: self.rate,
            "overhead": self.overhead,
            "grad_bandwidth": self.grad_bandwidth,
        }

    @property
    def measured(self) -> frozenset[str]:
        return frozenset(self.values()) if self.n else frozenset()


@dataclass(frozen=True)
class _MemoryFit:
    """The optimizer step's memory speed and a free's time."""

    mem_bandwidth: float
    norm_bandwidth: float | None
    free: float
    measured: frozenset[str]


def _spans_to_fit(compiled: Compiled, trace: Trace, name: str) -> list[TracedOp]:
    """The trace's spans, its first step (warm-up) left out when it has more, each checked
    to be the schedule's."""
    every = trace.spans
    have = sorted({s.step for s in every})
    used = [s for s in every if s.step != have[0]] if len(have) > 1 else every
    if not used:
        raise TraceError(f"{name} holds no op spans; was it written by `schedc run --trace`?")
    against(compiled, used, name)
    return used


def _compute_points(
    spec: Spec, used: list[TracedOp], trace: Trace, name: str, notes: list[str]
) -> list[tuple[float, float, float]]:
    """(FLOPs, gradient bytes, seconds) of each distinct fwd/bwd op, and of each layer the
    compute probe (--probe) timed at other micro sizes, which set apart what a backward
    costs per call (its gradient bytes, the overhead) from what it costs per token."""
    points = [
        (op_flops(spec, op), grad_bytes(spec, op), t)
        for op, t in _medians(
            (s.op, s.end - s.start) for s in used if s.op.kind in (Kind.FWD, Kind.BWD)
        )
    ]
    probed = compute_probes(trace, name)
    for op, _, _ in probed:
        if op.target not in spec.model.layers:
            raise TraceError(
                f"{name}: the probe timed layer {op.target!r}, which the schedule's model "
                "lacks: a trace of another schedule?"
            )
    if probed:
        sizes = sorted({m for _, m, _ in probed})
        notes.append(
            f"compute: with the probe's {len(probed)} layer timings at micro "
            + ", ".join(map(str, sizes))
        )
    return points + [(op_flops(spec, op, m), grad_bytes(spec, op), t) for op, m, t in probed]


def _fit_compute(
    spec: Spec, base: CostModel, points: list[tuple[float, float, float]], notes: list[str]
) -> _ComputeFit:
    """The compute term over `points`, or `base`'s where they cannot set it."""
    key = base.rate_key(spec.numerics)
    fit = _ComputeFit(key, base.rate(spec.numerics), base.overhead, base.grad_bandwidth)
    if not points:
        notes.append("no fwd/bwd spans: compute throughput kept")
        return fit
    coef = _compute_coefficients(points)
    if coef is not None and coef[0] > 0:
        grad = 1.0 / coef[1] if coef[1] > 0 else None
        fit = replace(fit, rate=1.0 / coef[0], overhead=coef[2], grad_bandwidth=grad)
    else:
        notes.append("compute time does not grow with FLOPs: compute throughput kept")
    model = replace(
        base,
        flops=None,
        overhead=fit.overhead,
        grad_bandwidth=fit.grad_bandwidth,
        **{key: fit.rate},
    )
    error = rms([t - compute_time(f, g, fit.rate, model) for f, g, t in points])
    return replace(fit, n=len(points), rms=error, mean=sum(t for *_, t in points) / len(points))


def _compute_coefficients(points: list[tuple[float, float, float]]) -> list[float] | None:
    """(1/F, 1/G, overhead) by non-negative least squares, F's required; None if none fits."""
    rows = [(f, g, 1.0) for f, g, _ in points]
    coef = nnls(rows, [t for *_, t in points], required=(0,))
    if coef is None:
        return None
    top = max(t for *_, t in points)  # a term adding under 1e-9 of the longest op is round-off
    return [c if c * max(col) > 1e-9 * top else 0.0 for c, col in zip(coef, zip(*rows))]


def _comm_points(
    spec: Spec, base: CostModel, used: list[TracedOp], trace: Trace, name: str, notes: list[str]
) -> CommPoints:
    """(volume, seconds) of each distinct collective, and of each kind the schedule never
    runs that the probe (--probe) timed."""
    # a collective moves data from the moment the last rank reaches it (the simulator's rule);
    # earlier ranks' spans also hold their wait for that rank, which is skew, not bandwidth
    ranks_at: dict[tuple[int, Op], list[TracedOp]] = {}
    for s in used:
        if s.op.is_collective:
            ranks_at.setdefault((s.step, s.op), []).append(s)
    points = CommPoints([], [], {})
    for op, t in _medians(
        (op, max(x.end for x in xs) - max(x.start for x in xs)) for (_, op), xs in ranks_at.items()
    ):
        point = (comm_volume(spec, op), t)
        if spans_nodes(spec, op, base.node_size):
            points.across.append(point)
        else:
            points.within.append(point)
            points.kinds.setdefault(op.kind, []).append(point)
    # a kind the schedule never runs, timed by the probe (--probe), within one node
    if base.node_size is None or base.node_size >= spec.world:
        for kind, probed in probes(trace, name).items():
            if kind not in points.kinds:
                points.kinds[kind] = probed
                points.within.extend(probed)
                notes.append(f"{kind.value}: fitted to the probe's {len(probed)} sizes")
    return points


def _fit_memory(spec: Spec, base: CostModel, used: list[TracedOp]) -> _MemoryFit:
    """mem_bandwidth (and norm_bandwidth with it) from the optimizer step; free's time."""
    opt = [s.end - s.start for s in used if s.op.kind is Kind.STEP]
    frees = [s.end - s.start for s in used if s.op.kind is Kind.FREE]
    timed = bool(opt) and median(opt) > 0
    mem = optimizer_bytes(spec, norm=True) / median(opt) if timed else base.mem_bandwidth
    measured = ({"mem_bandwidth", "norm_bandwidth"} if opt else set()) | (
        {"free"} if frees else set()
    )
    return _MemoryFit(
        mem,
        mem if timed else base.norm_bandwidth,
        median(frees) if frees else base.free,
        frozenset(measured),
    )


def _fitted_model(
    base: CostModel, compute: _ComputeFit, comm: CommFit, memory: _MemoryFit, notes: list[str]
) -> CostModel:
    """`base` with every fitted value that is usable (the others kept, with a note) and no
    one-rate `flops`."""
    fitted: dict[str, float | None] = {
        **compute.values(),
        **comm.per_kind,
        "bandwidth": comm.bandwidth,
        "latency": comm.latency,
        "mem_bandwidth": memory.mem_bandwidth,
        "norm_bandwidth": memory.norm_bandwidth,
        "free": memory.free,
    }
    for k, v in fitted.items():  # spans of 1e-300 us or 1e17 us fit, but to nothing usable
        if v is not None and not _usable(k, v):
            notes.append(f"the fitted {k} ({v:g}) is not a usable value: kept")
            fitted[k] = getattr(base, k)
    if comm.inter is not None:
        if _usable("inter_bandwidth", comm.inter):
            fitted["inter_bandwidth"] = comm.inter
        else:
            notes.append(f"the fitted inter_bandwidth ({comm.inter:g}) is not a usable value: kept")
    # a None is `base`'s own value, unset, but for grad_bandwidth: the fit may drop that term
    values = {k: v for k, v in fitted.items() if v is not None and k != "grad_bandwidth"}
    return replace(base, flops=None, grad_bandwidth=fitted["grad_bandwidth"], **values)


def _usable(name: str, v: float) -> bool:
    return math.isfinite(v) and (v > 0 or name in MAY_BE_ZERO and v == 0)


def _medians(samples: Iterable[tuple[Op, float]]) -> list[tuple[Op, float]]:
    """(op, duration) samples -> one (op, median duration) per distinct op, any micro-step."""
    by: dict[Op, list[float]] = {}
    for op, t in samples:
        by.setdefault(op._replace(mb=0), []).append(t)
    return [(op, median(ts)) for op, ts in sorted(by.items(), key=lambda kv: str(kv[0]))]
