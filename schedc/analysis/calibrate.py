"""The cost model fitted to a measured trace: `schedc calibrate`, and the refit of `schedc
tune --measure`.

    calibrate(compiled, trace)  -> Fit    compute throughput from fwd/bwd spans, bandwidth and
                                          latency from collectives, memory bandwidth from the
                                          optimizer step
    probes(trace)               -> {kind: [(volume, seconds)]}   the collective probe's points
    compute_probes(trace)       -> [(op, micro, seconds)]        the compute probe's timings

The probes are the events `schedc run --trace --probe` adds (exec/probe.py). Nothing here
imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from schedc.analysis.cost import (
    MAY_BE_ZERO,
    CostModel,
    comm_volume,
    compute_time,
    grad_bytes,
    op_flops,
    optimizer_bytes,
    ring_factor,
    spans_nodes,
)
from schedc.analysis.trace.compare import against
from schedc.analysis.trace.schema import (
    MAX_RANK,
    Trace,
    TracedOp,
    TraceError,
    check_object,
    check_time,
    is_int,
)
from schedc.analysis.units import fmt_rate, fmt_time
from schedc.compiler import Compiled
from schedc.ir.op import Kind, Op

# -- the probes (`schedc run --trace --probe`) -----------------------------------------------------

PROBE_KINDS = {k.value: k for k in (Kind.ALLREDUCE, Kind.ALLGATHER, Kind.REDUCESCATTER)}


def probes(trace: Trace, name: str = "trace") -> dict[Kind, list[tuple[float, float]]]:
    """The collective probe of `schedc run --trace --probe` (exec/probe.py), per kind:
    (volume, seconds) points, volume = ring factor x the full buffer's bytes, and time from
    the last rank's start to the last rank's end, the median of the repetitions."""
    timed: dict[tuple[Kind, int, int, int], list[tuple[float, float]]] = {}
    for e, at, args in _probe_events(trace, name):
        if args.get("kind") in COMPUTE_PROBES:
            continue
        kind = PROBE_KINDS.get(args.get("kind"))
        nbytes, ranks, rep = args.get("bytes"), args.get("ranks"), args.get("rep")
        if kind is None or not all(is_int(v) for v in (nbytes, ranks, rep)):
            raise TraceError(f"{at}.args: a probe needs kind, bytes, ranks and rep")
        if not (0 < nbytes <= 1 << 40 and 2 <= ranks <= MAX_RANK):
            raise TraceError(f"{at}.args: bytes {nbytes} or ranks {ranks} out of range")
        check_time(e, "ts", at)
        check_time(e, "dur", at)
        ts = float(e["ts"]) / 1e6
        timed.setdefault((kind, nbytes, ranks, rep), []).append((ts, ts + float(e["dur"]) / 1e6))
    by_size: dict[tuple[Kind, int, int], list[float]] = {}
    for (kind, nbytes, ranks, _), xs in timed.items():
        t = max(end for _, end in xs) - max(start for start, _ in xs)
        by_size.setdefault((kind, nbytes, ranks), []).append(t)
    out: dict[Kind, list[tuple[float, float]]] = {}
    for (kind, nbytes, ranks), ts in sorted(by_size.items(), key=lambda kv: kv[0][1]):
        out.setdefault(kind, []).append((ring_factor(kind, ranks) * nbytes, _median(ts)))
    return out


COMPUTE_PROBES = {"fwd": Kind.FWD, "bwd": Kind.BWD}


def compute_probes(trace: Trace, name: str = "trace") -> list[tuple[Op, int, float]]:
    """The compute probe of `schedc run --trace --probe` (exec/probe.py): (op, micro size,
    seconds) per layer, kind and micro size, the median over ranks and repetitions."""
    timed: dict[tuple[Op, int], list[float]] = {}
    for e, at, args in _probe_events(trace, name):
        kind = COMPUTE_PROBES.get(args.get("kind"))
        if kind is None:
            continue
        layer, micro, rep = args.get("layer"), args.get("micro"), args.get("rep")
        if not (isinstance(layer, str) and is_int(micro) and is_int(rep)):
            raise TraceError(f"{at}.args: a compute probe needs kind, layer, micro and rep")
        if not 0 < micro <= MAX_RANK:
            raise TraceError(f"{at}.args: micro {micro} out of range")
        check_time(e, "dur", at)
        timed.setdefault((Op(kind, layer), micro), []).append(float(e["dur"]) / 1e6)
    return [(op, micro, _median(ts)) for (op, micro), ts in sorted(timed.items(), key=str)]


def _probe_events(trace: Trace, name: str):
    """(event, where, args) of every probe event, args checked to be an object."""
    for i, e in trace.probes:
        at = f"{name}: traceEvents[{i}]"
        args = e.get("args")
        check_object(args, f"{at}.args", present="args" in e)
        yield e, at, args


# -- the fit ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
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

        def err(rms, mean):
            return (
                f"rms error {fmt_time(rms)} ({100 * rms / mean:.1f}% of the mean)"
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
                    ("gather", "all-gather", c.gather_bandwidth, c.gather_latency),
                    ("scatter", "reduce-scatter", c.scatter_bandwidth, c.scatter_latency),
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
    every = trace.spans
    have = sorted({s.step for s in every})
    used = [s for s in every if s.step != have[0]] if len(have) > 1 else every
    if not used:
        raise TraceError(f"{name} holds no op spans; was it written by `schedc run --trace`?")
    against(compiled, used, name)
    notes = []
    comp = [
        (op_flops(spec, op), grad_bytes(spec, op), t)
        for op, t in _medians(
            (s.op, s.end - s.start) for s in used if s.op.kind in (Kind.FWD, Kind.BWD)
        )
    ]
    # the compute probe (--probe): layers timed at other micro sizes, which set apart what a
    # backward costs per call (its gradient bytes, the overhead) from what it costs per token
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
    comp += [(op_flops(spec, op, m), grad_bytes(spec, op), t) for op, m, t in probed]
    key = base.rate_key(spec.numerics)
    rate = base.rate(spec.numerics)
    compute = {key: rate, "overhead": base.overhead, "grad_bandwidth": base.grad_bandwidth}
    c_rms, c_mean = 0.0, 0.0
    if comp:
        coef = _nnls([(f, g, 1.0) for f, g, _ in comp], [t for *_, t in comp], required=(0,))
        if coef is not None:  # a term adding under 1e-9 of the longest op is round-off: 0
            top = max(t for *_, t in comp)
            cols = list(zip(*[(f, g, 1.0) for f, g, _ in comp]))
            coef = [c if c * max(col) > 1e-9 * top else 0.0 for c, col in zip(coef, cols)]
        if coef is not None and coef[0] > 0:
            compute = {
                key: 1.0 / coef[0],
                "overhead": coef[2],
                "grad_bandwidth": 1.0 / coef[1] if coef[1] > 0 else None,
            }
        else:
            notes.append("compute time does not grow with FLOPs: compute throughput kept")
        fitted_model = replace(base, flops=None, **compute)
        c_rms = _rms([t - compute_time(f, g, compute[key], fitted_model) for f, g, t in comp])
        c_mean = sum(t for *_, t in comp) / len(comp)
    else:
        notes.append("no fwd/bwd spans: compute throughput kept")
    # a collective moves data from the moment the last rank reaches it (the simulator's rule);
    # earlier ranks' spans also hold their wait for that rank, which is skew, not bandwidth
    ranks_at: dict[tuple[int, Op], list[TracedOp]] = {}
    for s in used:
        if s.op.is_collective:
            ranks_at.setdefault((s.step, s.op), []).append(s)
    links: dict[bool, list[tuple[float, float]]] = {False: [], True: []}  # spans nodes?
    kinds: dict[Kind, list[tuple[float, float]]] = {}  # within a node, by kind
    for op, t in _medians(
        (op, max(x.end for x in xs) - max(x.start for x in xs)) for (_, op), xs in ranks_at.items()
    ):
        point = (comm_volume(spec, op), t)
        across = spans_nodes(spec, op, base.node_size)
        links[across].append(point)
        if not across:
            kinds.setdefault(op.kind, []).append(point)
    # a kind the schedule never runs, timed by the probe (--probe), within one node
    if base.node_size is None or base.node_size >= spec.world:
        for kind, points in probes(trace, name).items():
            if kind not in kinds:
                kinds[kind] = points
                links[False] += points
                notes.append(f"{kind.value}: fitted to the probe's {len(points)} sizes")
    coll = links[False] + links[True]
    bandwidth, latency, m_rms, m_mean = base.bandwidth, base.latency, 0.0, 0.0
    inter = base.inter_bandwidth
    per_kind: dict[str, float | None] = {}
    if links[False]:
        # all-reduces set the link (every collective together when there are none)
        first = kinds.get(Kind.ALLREDUCE) or links[False]
        bandwidth, latency = _fit_link(first, base.bandwidth, base.latency, notes, spec)
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
    if links[True]:  # a group across nodes (HSDP's replicate groups, or a flat world)
        inter, lat = _fit_link(
            links[True], base.inter_bandwidth or base.bandwidth, latency, notes, spec
        )
        if not links[False]:
            latency = lat
            notes.append("no collective within one node: the intra-node bandwidth is kept")
    if coll:
        priced = replace(base, bandwidth=bandwidth, latency=latency, **per_kind)
        m_rms = _rms(
            [
                t - priced.link_of(kind)[0] - x / priced.link_of(kind)[1]
                for kind, xs in kinds.items()
                for x, t in xs
            ]
            + [t - latency - x / inter for x, t in links[True]]
        )
        m_mean = sum(t for _, t in coll) / len(coll)
    else:
        notes.append("no collective spans: bandwidth and latency kept")
    opt = [s.end - s.start for s in used if s.op.kind is Kind.STEP]
    mem = base.mem_bandwidth
    if opt and _median(opt) > 0:
        mem = optimizer_bytes(spec, norm=True) / _median(opt)
    frees = [s.end - s.start for s in used if s.op.kind is Kind.FREE]
    free = _median(frees) if frees else base.free
    fitted = {
        **compute,
        **per_kind,
        "bandwidth": bandwidth,
        "latency": latency,
        "mem_bandwidth": mem,
        "norm_bandwidth": mem if opt and _median(opt) > 0 else base.norm_bandwidth,
        "free": free,
    }
    for k, v in fitted.items():  # spans of 1e-300 us or 1e17 us fit, but to nothing usable
        if v is None:
            continue
        if not (math.isfinite(v) and (v > 0 or k in MAY_BE_ZERO and v == 0)):
            notes.append(f"the fitted {k} ({v:g}) is not a usable value: kept")
            fitted[k] = getattr(base, k)
    if links[True] and inter is not None:
        if math.isfinite(inter) and inter > 0:
            fitted["inter_bandwidth"] = inter
        else:
            notes.append(f"the fitted inter_bandwidth ({inter:g}) is not a usable value: kept")
    cost = replace(base, flops=None, **fitted)
    measured = set(per_kind) | ({"mem_bandwidth", "norm_bandwidth"} if opt else set())
    measured |= {key, "overhead", "grad_bandwidth"} if comp else set()
    measured |= {"bandwidth", "latency"} if Kind.ALLREDUCE in kinds else set()
    measured |= {"free"} if frees else set()
    measured |= {"inter_bandwidth"} if links[True] else set()
    return Fit(
        cost,
        len(comp),
        c_rms,
        c_mean,
        len(coll),
        m_rms,
        m_mean,
        tuple(notes),
        key,
        len(links[True]),
        frozenset(measured),
    )


def _fit_link(
    coll: list[tuple[float, float]],
    bandwidth: float,
    latency: float,
    notes: list[str],
    spec,
    what: str = "",
) -> tuple[float, float]:
    """t = latency + volume / bandwidth by least squares over one link's collectives (or one
    kind's: `what` names it in the notes)."""
    notes_before = len(notes)
    fit = _fit_line(coll, bandwidth, latency, notes, spec)
    if what:
        notes[notes_before:] = [f"{what}: {n}" for n in notes[notes_before:]]
    return fit


def _fit_line(coll, bandwidth: float, latency: float, notes: list[str], spec):
    a, b = _line(coll)
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
        a, b = 0.0, _origin(coll)
    elif a < 0:
        notes.append("the best line has negative latency: latency fixed at 0")
        a, b = 0.0, _origin(coll)
    if b > 0:
        return 1.0 / b, a
    notes.append("collective time does not grow with bytes: bandwidth kept, latency is the mean")
    return bandwidth, sum(t for _, t in coll) / len(coll)


def _nnls(rows, ts, required=()) -> list[float] | None:
    """Least squares t = rows . x with every x >= 0: each subset of the columns (those in
    `required` always in) solved by its normal equations, the best feasible one kept; the
    dropped columns are 0. None when no subset has a non-negative solution."""
    n = len(rows[0])
    optional = [j for j in range(n) if j not in required]
    best, best_err = None, math.inf
    for mask in range(1 << len(optional)):
        cols = sorted([*required, *(j for i, j in enumerate(optional) if mask >> i & 1)])
        x = _solve(
            [[sum(r[a] * r[b] for r in rows) for b in cols] for a in cols],
            [sum(r[a] * t for r, t in zip(rows, ts)) for a in cols],
        )
        if x is None or any(v < 0 for v in x):
            continue
        full = [0.0] * n
        for j, v in zip(cols, x):
            full[j] = v
        err = sum((t - sum(c * v for c, v in zip(r, full))) ** 2 for r, t in zip(rows, ts))
        if err < best_err * (1 - 1e-12):  # ties go to the fewer columns (found first)
            best, best_err = full, err
    return best


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (Gaussian elimination, columns scaled first); None if singular."""
    n = len(b)
    scale = [math.sqrt(a[i][i]) or 1.0 for i in range(n)]
    m = [[a[i][j] / (scale[i] * scale[j]) for j in range(n)] + [b[i] / scale[i]] for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-9:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] / scale[i] for i in range(n)]


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _medians(samples) -> list[tuple[Op, float]]:
    """(op, duration) samples -> one (op, median duration) per distinct op, any micro-step."""
    by: dict[Op, list[float]] = {}
    for op, t in samples:
        by.setdefault(op._replace(mb=0), []).append(t)
    return [(op, _median(ts)) for op, ts in sorted(by.items(), key=lambda kv: str(kv[0]))]


def _line(points) -> tuple[float, float | None]:
    """Ordinary least squares t = a + b x; b is None when x does not vary."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 1e-12 * max(1.0, mx * mx) * n:
        return mt, None
    b = sum((x - mx) * (t - mt) for x, t in points) / sxx
    return mt - b * mx, b


def _origin(points) -> float:
    sxx = sum(x * x for x, _ in points)
    return sum(x * t for x, t in points) / sxx if sxx else 0.0


def _rms(residuals) -> float:
    return math.sqrt(sum(r * r for r in residuals) / len(residuals)) if residuals else 0.0
