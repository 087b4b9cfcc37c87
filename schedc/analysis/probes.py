"""The probes' timings read back from a trace: the events `schedc run --trace --probe` adds
(exec/probe.py), which `schedc calibrate` fits beside the schedule's own ops.

    probes(trace)          -> {kind: [(volume, seconds)]}   the collective probe's points
    compute_probes(trace)  -> [(op, micro, seconds)]        the compute probe's timings

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from statistics import median
from typing import Any

from schedc.analysis.cost import ring_factor
from schedc.analysis.trace.schema import (
    MAX_RANK,
    Trace,
    TraceError,
    check_object,
    check_time,
    is_int,
)
from schedc.ir.op import Kind, Op

PROBE_KINDS = {k.value: k for k in (Kind.ALLREDUCE, Kind.ALLGATHER, Kind.REDUCESCATTER)}
COMPUTE_PROBES = {"fwd": Kind.FWD, "bwd": Kind.BWD}


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
    for (kind, nbytes, ranks), times in sorted(by_size.items(), key=lambda kv: kv[0][1]):
        out.setdefault(kind, []).append((ring_factor(kind, ranks) * nbytes, median(times)))
    return out


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
    return [(op, micro, median(ts)) for (op, micro), ts in sorted(timed.items(), key=str)]


def _probe_events(trace: Trace, name: str) -> Iterator[tuple[dict, str, Any]]:
    """(event, where, args) of every probe event, args checked to be an object (of JSON
    values, any of which the reader checks)."""
    for i, e in trace.probes:
        at = f"{name}: traceEvents[{i}]"
        args = e.get("args")
        check_object(args, f"{at}.args", present="args" in e)
        yield e, at, args
