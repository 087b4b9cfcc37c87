"""What `schedc run --trace` writes (docs/trace.md, "What a run writes"): one constructor per
kind of event, the only place an event's shape is spelled out; the executor, the probe
(exec/probe.py) and `chrome_trace` write through them. Times are microseconds on the run's
clock."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from schedc.analysis.simulate import Timeline
from schedc.analysis.trace.schema import PROBE
from schedc.ir.op import Op


@dataclass
class Timed:
    """One op's time on its stream, for the trace (ns, CLOCK_MONOTONIC)."""

    op: Op
    stream: str
    start: int
    end: int
    issue: int = 0  # host time the op was issued (collectives)


def chrome_events(
    rank: int,
    streams: Iterable[str],
    spans: list[tuple[int, Timed]],
    steps: Sequence[tuple[int, int, int]] = (),
) -> list[dict]:
    """Chrome/Perfetto trace events: one process per rank, one thread per stream, each op a
    slice named by its IR text (the same text on every rank); with `steps`, a "steps" thread
    drawn above them whose slices `step N` run from the step's start (before its batch is
    loaded) to the end of its synchronize."""
    tid = {s: i for i, s in enumerate(streams)}
    events = process_events(rank, sort=rank)
    threads = [*tid.items(), *([("steps", len(tid))] if steps else [])]
    for s, i in threads:
        sort = -1 if i == len(tid) else i  # the steps track first
        events += thread_events(rank, i, s, sort)
    for step, start, end in steps:
        events.append(step_event(step, rank, len(tid), start / 1e3, max(0.0, (end - start) / 1e3)))
    for step, sp in spans:
        ts, dur = sp.start / 1e3, max(0.0, (sp.end - sp.start) / 1e3)
        events.append(
            op_event(
                sp.op,
                sp.stream,
                step,
                rank,
                tid[sp.stream],
                ts,
                dur,
                launch=sp.issue / 1e3,
                complete=sp.end / 1e3,
            )
        )
    return events


def trace_file(events: list[dict], schedule: str | None) -> dict:
    """The trace file's JSON: every rank's events and, when given, the schedule that ran."""
    trace: dict = {"traceEvents": events, "displayTimeUnit": "ms"}
    if schedule is not None:
        trace["otherData"] = {"schedule": schedule}
    return trace


def chrome_trace(tl: Timeline, step: int = 0, path: str = "") -> dict:
    """A timeline written the way `schedc run --trace` writes one (us, pid = rank), without
    the sort-index events."""
    events = []
    for r in tl.ranks:
        events += process_events(r)
        for t, s in enumerate(tl.streams):
            events += thread_events(r, t, s)
    tid = {s: t for t, s in enumerate(tl.streams)}
    for r in tl.ranks:  # the step's slice on the steps track, as the executor writes it
        mine = [i for i in tl.intervals if i.rank == r]
        start = min((i.start for i in mine), default=0.0)
        end = max((i.end for i in mine), default=0.0)
        events += thread_events(r, len(tid), "steps")
        events.append(step_event(step, r, len(tid), start * 1e6, (end - start) * 1e6))
    for i in tl.intervals:
        ts, dur = i.start * 1e6, i.length * 1e6
        events.append(
            op_event(
                i.op,
                i.stream,
                step,
                i.rank,
                tid[i.stream],
                ts,
                dur,
                launch=ts,
                complete=i.end * 1e6,
            )
        )
    return trace_file(events, path or None)


def process_events(rank: int, sort: int | None = None) -> list[dict]:
    """A rank's process: named `rank N`, placed `sort`-th among processes when given."""
    events = [_meta("process_name", rank, None, {"name": f"rank {rank}"})]
    if sort is not None:
        events.append(_meta("process_sort_index", rank, None, {"sort_index": sort}))
    return events


def thread_events(rank: int, tid: int, name: str, sort: int | None = None) -> list[dict]:
    """A thread of a rank: named after its stream (or `steps`, `probe`), placed `sort`-th
    among the rank's threads when given."""
    events = [_meta("thread_name", rank, tid, {"name": name})]
    if sort is not None:
        events.append(_meta("thread_sort_index", rank, tid, {"sort_index": sort}))
    return events


def op_event(
    op: Op,
    stream: str,
    step: int,
    rank: int,
    tid: int,
    ts: float,
    dur: float,
    *,
    launch: float,
    complete: float,
) -> dict:
    """An op span, named by its IR text; a collective's args also say when the host issued
    it (`launch`) and when it completed."""
    args: dict = {"step": step, "stream": stream}
    if op.is_collective:
        args |= {"launch_us": launch, "complete_us": complete}
    cat = "collective" if op.is_collective else "compute"
    return _slice(str(op), rank, tid, ts, dur, cat, args)


def step_event(step: int, rank: int, tid: int, ts: float, dur: float) -> dict:
    """A training step's slice `step N` on the steps track."""
    return _slice(f"step {step}", rank, tid, ts, dur, "step", {"step": step})


def probe_event(name: str, rank: int, tid: int, ts: float, dur: float, args: dict) -> dict:
    """One timing of `--probe` (exec/probe.py) on the probe thread; read back by
    analysis/probes.py."""
    return _slice(name, rank, tid, ts, dur, PROBE, args)


def _meta(name: str, rank: int, tid: int | None, args: dict) -> dict:
    event: dict = {"name": name, "ph": "M", "pid": rank}
    if tid is not None:
        event["tid"] = tid
    event["args"] = args
    return event


def _slice(name: str, rank: int, tid: int, ts: float, dur: float, cat: str, args: dict) -> dict:
    return {
        "name": name,
        "ph": "X",
        "pid": rank,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "cat": cat,
        "args": args,
    }
