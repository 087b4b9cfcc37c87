"""Measured timelines from `schedc run --trace` files, and the cost model fitted to them.

    measured(compiled, trace, step, ranks) -> Timeline   one step's spans, per rank and stream
    chrome_trace(timeline)                 -> dict       a timeline as a trace (for tests)
    calibrate(compiled, trace)             -> Fit        compute throughput from fwd/bwd spans,
                                                         bandwidth and latency from collectives

A trace holds Chrome "X" events named by IR text (`bwd[h.3]@mb1`) with pid = rank and
args.step / args.stream; `schedc.exec.executor.chrome_events` writes them. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from schedc.compiler import Compiled
from schedc.ir.op import Kind, Op, OpSyntaxError
from schedc.viz.cost import CostModel, comm_volume, op_flops, optimizer_bytes
from schedc.viz.simulate import Interval, Timeline, in_stream_order
from schedc.viz.units import fmt_rate, fmt_time


class TraceError(ValueError):
    """The trace cannot be read, or does not belong to the schedule it is drawn with."""


@dataclass(frozen=True)
class Span:
    rank: int
    step: int
    stream: str
    op: Op
    start: float  # seconds, the trace's clock
    end: float


def load(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TraceError(f"cannot read trace {path}: {e}") from None
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{path} is not a Chrome trace (no traceEvents list)")
    return data


def spans(trace: dict) -> list[Span]:
    """Every op span in the trace (events whose name is not an op are skipped)."""
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name")
               for e in trace["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    out = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        try:
            op = Op.parse(str(e.get("name", "")))
        except OpSyntaxError:
            continue
        args = e.get("args") or {}
        stream = (args.get("stream") or threads.get((e.get("pid"), e.get("tid")))
                  or str(e.get("tid")))
        ts = float(e["ts"]) / 1e6
        out.append(Span(int(e.get("pid", 0)), int(args.get("step", 0)), stream, op, ts,
                        ts + float(e.get("dur", 0.0)) / 1e6))
    return out


def steps(trace: dict) -> list[int]:
    return sorted({s.step for s in spans(trace)})


def measured(compiled: Compiled, trace: dict, step: int | None = None,
             ranks: list[int] | None = None, name: str = "trace") -> Timeline:
    """One step of the trace as a Timeline; times from the step's first span on any shown rank
    (on one machine every rank's clock is the same CLOCK_MONOTONIC, so ranks line up)."""
    every = spans(trace)
    if not every:
        raise TraceError(f"{name} holds no op spans; was it written by `schedc run --trace`?")
    have = sorted({s.step for s in every})
    step = have[-1] if step is None else step
    if step not in have:
        raise TraceError(f"{name} has no step {step}; it has steps {have[0]}..{have[-1]}")
    chosen = [s for s in every if s.step == step and (ranks is None or s.rank in ranks)]
    if not chosen:
        have_ranks = sorted({s.rank for s in every})
        raise TraceError(f"{name} has no rank {', '.join(map(str, ranks or []))}; "
                         f"it has ranks {', '.join(map(str, have_ranks))}")
    planned = {r: set(compiled.plan(r).ops) for r in {s.rank for s in chosen}}
    for s in chosen:
        if s.op not in planned[s.rank]:
            raise TraceError(
                f"{name}: rank {s.rank} ran {s.op}, which {compiled.source.path}'s plan does "
                "not hold; was the trace recorded from another schedule or with --model?")
    t0 = min(s.start for s in chosen)
    intervals = [Interval(s.rank, s.stream, s.op, s.start - t0, s.end - t0) for s in chosen]
    shown = tuple(sorted({s.rank for s in chosen}))
    streams = compiled.plan(shown[0]).streams
    return Timeline(compiled.spec, in_stream_order(intervals, streams), shown, streams,
                    "measured", note=f"{name}, step {step}")


def chrome_trace(tl: Timeline, step: int = 0, path: str = "") -> dict:
    """A timeline written the way `schedc run --trace` writes one (us, pid = rank)."""
    events = []
    for r in tl.ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        for t, s in enumerate(tl.streams):
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": t,
                           "args": {"name": s}})
    tid = {s: t for t, s in enumerate(tl.streams)}
    for i in tl.intervals:
        ev = {"name": str(i.op), "ph": "X", "pid": i.rank, "tid": tid[i.stream],
              "ts": i.start * 1e6, "dur": i.length * 1e6,
              "cat": "collective" if i.op.is_collective else "compute",
              "args": {"step": step, "stream": i.stream}}
        if i.op.is_collective:
            ev["args"]["launch_us"] = i.start * 1e6
            ev["args"]["complete_us"] = i.end * 1e6
        events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schedule": path}}


# -- calibration -----------------------------------------------------------------------------------


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

    def report(self) -> str:
        c = self.cost

        def err(rms, mean):
            return f"rms error {fmt_time(rms)} ({100 * rms / mean:.1f}% of the mean)" if mean \
                else "no spans"

        lines = [
            (f"compute     {fmt_rate(getattr(c, self.compute_key), 'FLOP/s')} "
             f"({self.compute_key})   from {self.compute_n} distinct "
             f"fwd/bwd ops, {err(self.compute_rms, self.compute_mean)}"),
            f"bandwidth   {fmt_rate(c.bandwidth, 'B/s')} (bus)",
            (f"latency     {fmt_time(c.latency)}   bandwidth and latency from {self.comm_n} "
             f"distinct collectives, {err(self.comm_rms, self.comm_mean)}"),
            f"memory      {fmt_rate(c.mem_bandwidth, 'B/s')} (optimizer step)",
            f"free        {fmt_time(c.free)}",
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def calibrate(compiled: Compiled, trace: dict, base: CostModel | None = None) -> Fit:
    """Least squares over the ops of the trace, skipping step 0 (warm-up) if there are more.

    Each distinct op (`bwd[h.3]`, `allreduce[b1]`, ...) is one point: the median of its
    durations over micro-steps, steps and ranks, so that an op the OS preempted on a busy
    machine does not pull the fit.
    compute:     t = flops(op) / F, through the origin (F = sum f^2 / sum f t); F is the
                 rate of the schedule's compute dtype (flops_bf16, flops_tf32 or
                 flops_fp32), the others keep `base`'s values
    collectives: t = latency + volume(op) / bandwidth, volume = ring factor x bytes, and
                 t from the last rank's arrival to the last rank's completion
    optimizer:   mem_bandwidth = bytes / t;   free: t
    What a trace cannot determine keeps `base`'s value, with a note.
    """
    spec, base = compiled.spec, base or CostModel()
    every = spans(trace)
    have = sorted({s.step for s in every})
    used = [s for s in every if s.step != have[0]] if len(have) > 1 else every
    if not used:
        raise TraceError("the trace holds no op spans")
    notes = []
    comp = [(op_flops(spec, op), t) for op, t in _medians(
        (s.op, s.end - s.start) for s in used if s.op.kind in (Kind.FWD, Kind.BWD))]
    key = base.rate_key(spec.numerics)
    flops, c_rms, c_mean = base.rate(spec.numerics), 0.0, 0.0
    if comp:
        sff = sum(f * f for f, _ in comp)
        sft = sum(f * t for f, t in comp)
        if sft > 0:
            flops = sff / sft
        c_rms = _rms([t - f / flops for f, t in comp])
        c_mean = sum(t for _, t in comp) / len(comp)
    else:
        notes.append("no fwd/bwd spans: compute throughput kept")
    # a collective moves data from the moment the last rank reaches it (the simulator's rule);
    # earlier ranks' spans also hold their wait for that rank, which is skew, not bandwidth
    ranks_at: dict[tuple[int, Op], list[Span]] = {}
    for s in used:
        if s.op.is_collective:
            ranks_at.setdefault((s.step, s.op), []).append(s)
    coll = [(comm_volume(spec, op), t) for op, t in _medians(
        (op, max(x.end for x in xs) - max(x.start for x in xs))
        for (_, op), xs in ranks_at.items())]
    bandwidth, latency, m_rms, m_mean = base.bandwidth, base.latency, 0.0, 0.0
    if coll:
        a, b = _line(coll)
        if b is None and all(x == 0 for x, _ in coll):
            notes.append(f"world {spec.world}: collectives move no data, so only their "
                         "latency is measured; bandwidth kept")
            latency = sum(t for _, t in coll) / len(coll)
        else:
            if b is None:
                notes.append("every collective moves the same volume: latency fixed at 0 "
                             "and bandwidth fitted through the origin")
                a, b = 0.0, _origin(coll)
            elif a < 0:
                notes.append("the best line has negative latency: latency fixed at 0")
                a, b = 0.0, _origin(coll)
            if b > 0:
                bandwidth, latency = 1.0 / b, a
            else:
                notes.append("collective time does not grow with bytes: bandwidth kept, "
                             "latency is the mean")
                latency = sum(t for _, t in coll) / len(coll)
        m_rms = _rms([t - latency - x / bandwidth for x, t in coll])
        m_mean = sum(t for _, t in coll) / len(coll)
    else:
        notes.append("no collective spans: bandwidth and latency kept")
    opt = [s.end - s.start for s in used if s.op.kind is Kind.STEP]
    mem = base.mem_bandwidth
    if opt and _median(opt) > 0:
        mem = optimizer_bytes(spec) / _median(opt)
    frees = [s.end - s.start for s in used if s.op.kind is Kind.FREE]
    free = _median(frees) if frees else base.free
    cost = replace(base, flops=None, **{key: flops}, bandwidth=bandwidth, latency=latency,
                   mem_bandwidth=mem, free=free)
    return Fit(cost, len(comp), c_rms, c_mean, len(coll), m_rms, m_mean, tuple(notes), key)


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
