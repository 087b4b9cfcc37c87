"""The cost model and the simulator: how long each op of a plan takes, and when it runs.

    duration   fwd         FLOPs of the layer for one micro-batch / flops
               bwd         2 x fwd
               collective  latency + ring(kind, D) x bytes / bandwidth
                           ring: all-reduce 2(D-1)/D, all-gather and reduce-scatter (D-1)/D
               free        free (a storage release, no kernel)
               optimizer   28 bytes x parameters on the rank / mem_bandwidth (fp32 AdamW)
    simulate   Compiled -> Timeline: every stream runs its ops in program order, one at a
               time; an op starts when its stream is free and every event it waits for has
               fired; a collective starts when every rank has reached it.
    overlap    Timeline -> per rank, how much collective time is hidden behind compute.

The defaults describe one node of current data-centre GPUs (see `CostModel`); every number
can be set on the command line or fitted to a measured trace (`schedc calibrate`).
Times are seconds. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import networkx as nx

from schedc.arch import FP32
from schedc.compiler import Compiled
from schedc.ir import Kind, Op
from schedc.memory import op_bytes, padded, unit_numel
from schedc.resolve import FSDPSpec, Spec

COMPUTING = frozenset({Kind.FWD, Kind.BWD, Kind.STEP})  # what hides communication
ADAMW_BYTES = 7 * FP32  # per parameter: read param, grad, m, v; write param, m, v


@dataclass(frozen=True)
class CostModel:
    """Throughputs and fixed costs of one GPU and its links (SI units)."""

    flops: float = 300e12
    """Effective compute throughput, FLOP/s. An H100-class GPU sustains 300-400 TFLOP/s on
    GPT-2's matmuls in bf16/tf32 (40% of its dense peak); an A100 about half of that."""
    bandwidth: float = 100e9
    """Bus bandwidth per GPU, bytes/s, as nccl-tests reports it (busbw: the ring factor is
    applied separately). 100 GB/s is a conservative NVLink ring or a 4 x 200 Gb/s
    InfiniBand node; NVLink 4 within one H100 node measures 300-450 GB/s."""
    latency: float = 10e-6
    """Fixed cost of one collective, seconds: launch plus the ring's hop latencies."""
    mem_bandwidth: float = 2e12
    """Effective HBM bandwidth, bytes/s, for the memory-bound optimizer step."""
    free: float = 1e-6
    """Releasing a gathered unit's storage, seconds (host-side bookkeeping, no kernel)."""

    def describe(self) -> str:
        return (f"{fmt_rate(self.flops, 'FLOP/s')} compute, {fmt_rate(self.bandwidth, 'B/s')} "
                f"bus bandwidth, {fmt_time(self.latency)} per collective")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """A params.json as `schedc calibrate -o` writes it; keys it lacks keep their default."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            # a file's content: a bad value, not a programming error's TypeError
            raise ValueError(f"{path}: expected a JSON object of cost parameters")  # noqa: TRY004
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown cost parameter(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        values = {k: float(v) for k, v in data.items()}
        bad = [k for k, v in values.items() if not v > 0 and k not in ("latency", "free")]
        if bad or any(v < 0 for v in values.values()):
            raise ValueError(f"{path}: cost parameters must be positive ({', '.join(bad)})")
        return cls(**values)

    def with_(self, **changes: float | None) -> CostModel:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


# -- durations ------------------------------------------------------------------------------------


def ring_factor(kind: Kind, world: int) -> float:
    """Bytes each rank sends per byte of the collective's (full) buffer, on a ring."""
    if kind is Kind.ALLREDUCE:
        return 2 * (world - 1) / world
    if kind in (Kind.ALLGATHER, Kind.REDUCESCATTER):
        return (world - 1) / world
    return 0.0


def op_flops(spec: Spec, op: Op) -> float:
    """FLOPs of a forward or backward op for one micro-batch (backward = 2 x forward)."""
    if op.kind not in (Kind.FWD, Kind.BWD):
        return 0.0
    f = spec.model.layer_fwd_flops(op.target, spec.micro * spec.seq_len, spec.seq_len)
    return 2 * f if op.kind is Kind.BWD else f


def comm_volume(spec: Spec, op: Op) -> float:
    """Bytes each rank moves for a collective on a ring: ring factor x buffer bytes."""
    return ring_factor(op.kind, spec.world) * op_bytes(spec, op)


def optimizer_bytes(spec: Spec) -> float:
    """Bytes AdamW reads and writes on one rank (FSDP: its shards only)."""
    if isinstance(spec.strategy, FSDPSpec):
        n = sum(padded(unit_numel(spec, u), spec.world) for u in spec.strategy.units)
        return ADAMW_BYTES * n / spec.world
    return ADAMW_BYTES * spec.model.numel


def duration(spec: Spec, op: Op, cost: CostModel) -> float:
    if op.kind in (Kind.FWD, Kind.BWD):
        return op_flops(spec, op) / cost.flops
    if op.is_collective:
        return cost.latency + comm_volume(spec, op) / cost.bandwidth
    if op.kind is Kind.FREE:
        return cost.free
    return optimizer_bytes(spec) / cost.mem_bandwidth


# -- timelines ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """One op on one rank's stream, from start to end (seconds from the step's start)."""

    rank: int
    stream: str
    op: Op
    start: float
    end: float

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """When each op ran (measured) or would run (predicted), for one step."""

    spec: Spec
    intervals: list[Interval]  # per rank, per stream, in program order
    ranks: tuple[int, ...]
    streams: tuple[str, ...]
    source: str  # "predicted" | "measured"
    every_rank: bool = False  # one rank drawn for all: every rank runs the same plan
    note: str = ""  # the cost model, or the trace and step it was read from

    @property
    def compute_stream(self) -> str:
        return self.spec.streams[Kind.FWD]

    @property
    def end(self) -> float:
        return max((i.end for i in self.intervals), default=0.0)

    def on(self, rank: int, stream: str) -> list[Interval]:
        return [i for i in self.intervals if i.rank == rank and i.stream == stream]

    def find(self, op: Op | str, rank: int | None = None) -> Interval:
        op = Op.parse(op) if isinstance(op, str) else op
        rank = self.ranks[0] if rank is None else rank
        return next(i for i in self.intervals if i.op == op and i.rank == rank)


def simulate(compiled: Compiled, cost: CostModel | None = None,
             ranks: list[int] | None = None) -> Timeline:
    """Predict one step: the longest path through program order, events and collectives.

    When every rank runs the same plan one rank stands for all (collectives then start as
    soon as that rank reaches them); otherwise every rank is simulated and a collective
    starts when the last rank reaches it.
    """
    spec, cost = compiled.spec, cost or CostModel()
    distinct = any(r is not None for r in compiled.plans)
    sim = list(range(spec.world)) if distinct else [0]
    g = nx.DiGraph()
    runs: dict[int, list[tuple[str, Op, object]]] = {}

    def node(rank: int, stream: str, op: Op):
        return ("*", stream, op) if op.is_collective else (rank, op)

    for r in sim:
        plan = compiled.plan(r)
        last: dict[str, object] = {}
        waits: dict[str, list[object]] = {}
        runs[r] = []
        stream_of = {i.op: i.stream for i in plan.instrs if i.kind == "run"}
        for ins in plan.instrs:
            if ins.kind == "wait":
                p = plan.producers[ins.event]
                waits.setdefault(ins.stream, []).append(node(r, stream_of[p], p))
            elif ins.kind == "run":
                n = node(r, ins.stream, ins.op)
                g.add_node(n, length=duration(spec, ins.op, cost))
                preds = waits.pop(ins.stream, []) + ([last[ins.stream]] if ins.stream in last
                                                      else [])
                g.add_edges_from((p, n) for p in preds)
                last[ins.stream] = n
                runs[r].append((ins.stream, ins.op, n))
    try:
        order = list(nx.topological_sort(g))
    except nx.NetworkXUnfeasible:
        raise ValueError("the ranks issue their collectives in different orders: the "
                         "schedule would hang (schedc check reports where)") from None
    end: dict[object, float] = {}
    start: dict[object, float] = {}
    for n in order:
        start[n] = max((end[p] for p in g.predecessors(n)), default=0.0)
        end[n] = start[n] + g.nodes[n]["length"]
    shown = [r for r in sim if ranks is None or r in ranks] if distinct else [
        (ranks[0] if ranks else 0)]
    intervals = []
    for r in shown:
        for stream, op, n in runs[r if distinct else 0]:
            intervals.append(Interval(r, stream, op, start[n], end[n]))
    streams = compiled.plan(shown[0] if distinct else None).streams
    return Timeline(spec, in_stream_order(intervals, streams), tuple(shown), streams,
                    "predicted", every_rank=not distinct and spec.world > 1,
                    note=cost.describe())


def in_stream_order(intervals: list[Interval], streams) -> list[Interval]:
    rank_of = {s: i for i, s in enumerate(streams)}
    return sorted(intervals, key=lambda i: (i.rank, rank_of.get(i.stream, 99), i.start, i.end))


# -- hidden and exposed ---------------------------------------------------------------------------


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
        return (f"step {fmt_time(self.step)}; communication {fmt_time(self.comm)}: "
                f"{fmt_time(self.hidden)} hidden behind compute ({pct:.0f}%), "
                f"{fmt_time(self.exposed)} exposed")


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
        cover = busy([i for i in mine
                      if i.stream == tl.compute_stream and i.op.kind in COMPUTING])
        items = tuple(Exposure(i, split(i.start, i.end, cover))
                      for i in mine if i.op.is_collective)
        t0 = min((i.start for i in mine), default=0.0)
        out[r] = Overlap(r, max((i.end for i in mine), default=0.0) - t0, items)
    return out


# -- units ----------------------------------------------------------------------------------------


def fmt_time(s: float) -> str:
    a = abs(s)
    if a < 1e-12:
        return "0"
    if a >= 1:
        return f"{s:.3g} s" if a < 100 else f"{s:.0f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if a >= 1e-6:
        return f"{s * 1e6:.3g} us"
    return f"{s * 1e9:.3g} ns"


def fmt_rate(x: float, unit: str) -> str:
    for scale, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {p}{unit}"
    return f"{x:.3g} {unit}"


_SI = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_rate(text: str) -> float:
    """'300T', '300e12', '100G', '100GB/s', '2.5 TFLOP/s' -> a positive number per second."""
    t = text.strip().replace(" ", "")
    for tail in ("FLOP/s", "FLOPS", "flop/s", "flops", "B/s", "/s"):
        if t.endswith(tail):
            t = t[: -len(tail)]
            break
    mult = 1.0
    if t and t[-1] in _SI and not t[-1].isdigit():
        mult, t = _SI[t[-1]], t[:-1]
    value = float(t) * mult
    if not value > 0:
        raise ValueError(f"{text!r} is not a positive rate")
    return value


def parse_time(text: str) -> float:
    """'10us', '0.5ms', '1e-5' (seconds) -> seconds."""
    t = text.strip().replace(" ", "")
    for unit in sorted(_TIME, key=len, reverse=True):
        if t.endswith(unit) and t[: -len(unit)]:
            value = float(t[: -len(unit)]) * _TIME[unit]
            break
    else:
        value = float(t)
    if value < 0:
        raise ValueError(f"{text!r} is negative")
    return value
