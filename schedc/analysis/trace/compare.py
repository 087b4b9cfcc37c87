"""A trace against the schedule it is drawn with, and one of its steps as a Timeline: the
measured side of what the simulator predicts (analysis/simulate.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from schedc.analysis.simulate import Interval, Timeline, in_stream_order
from schedc.analysis.trace.schema import Trace, TracedOp, TraceError, printable
from schedc.compiler import Compiled
from schedc.ir.op import Op


def against(compiled: Compiled, chosen: list[TracedOp], name: str) -> None:
    """Every span's rank, stream and op must be the schedule's: a trace of another schedule,
    or one edited by hand, is refused here, naming the event, not deep in the drawing."""
    world, where = compiled.spec.world, f"{name}: traceEvents"
    planned: dict[int, set[Op]] = {}
    for s in chosen:
        if s.rank >= world:
            raise TraceError(
                f"{where}[{s.index}].pid: rank {s.rank}, but "
                f"{compiled.source.path} has ranks 0..{world - 1}"
            )
        plan = compiled.plan(s.rank)
        if s.stream not in plan.streams:
            raise TraceError(
                f"{where}[{s.index}]: stream {s.stream!r} is none of "
                f"{compiled.source.path}'s ({', '.join(plan.streams)})"
            )
        if s.op not in planned.setdefault(s.rank, set(plan.ops)):
            raise TraceError(
                f"{where}[{s.index}]: rank {s.rank} ran {printable(str(s.op))}, which "
                f"{compiled.source.path}'s plan does not hold; was the trace recorded from "
                "another schedule or with --model?"
            )


def steps(trace: Trace) -> list[int]:
    return sorted({s.step for s in trace.spans})


def step_times(trace: Trace) -> dict[int, float]:
    """Each step's span in the trace, seconds: its first op's start to its last op's end,
    over every rank."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for s in trace.spans:
        first[s.step] = min(first.get(s.step, s.start), s.start)
        last[s.step] = max(last.get(s.step, s.end), s.end)
    return {k: last[k] - first[k] for k in sorted(first)}


def only_step(trace: Trace, step: int | None) -> tuple[Trace, int]:
    """The trace cut to one step (the last when None), probes kept; and that step."""
    have = steps(trace)
    if not have:
        raise TraceError("the trace holds no op spans; was it written by `schedc run --trace`?")
    step = have[-1] if step is None else step
    if step not in have:
        raise TraceError(f"the trace has no step {step}; it has steps {have[0]}..{have[-1]}")
    return replace(trace, spans=[s for s in trace.spans if s.step == step]), step


def measured(
    compiled: Compiled,
    trace: Trace,
    step: int | None = None,
    ranks: list[int] | None = None,
    name: str = "trace",
) -> Timeline:
    """One step of the trace as a Timeline; times from the step's first span on any shown rank
    (on one machine every rank's clock is the same CLOCK_MONOTONIC, so ranks line up)."""
    every = trace.spans
    if not every:
        raise TraceError(f"{name} holds no op spans; was it written by `schedc run --trace`?")
    have = sorted({s.step for s in every})
    step = have[-1] if step is None else step
    if step not in have:
        raise TraceError(f"{name} has no step {step}; it has steps {have[0]}..{have[-1]}")
    chosen = [s for s in every if s.step == step and (ranks is None or s.rank in ranks)]
    if not chosen:
        have_ranks = sorted({s.rank for s in every})
        raise TraceError(
            f"{name} has no rank {', '.join(map(str, ranks or []))}; "
            f"it has ranks {', '.join(map(str, have_ranks))}"
        )
    against(compiled, chosen, name)
    t0 = min(s.start for s in chosen)
    intervals = [Interval(s.rank, s.stream, s.op, s.start - t0, s.end - t0) for s in chosen]
    shown = tuple(sorted({s.rank for s in chosen}))
    streams = compiled.plan(shown[0]).streams
    return Timeline(
        compiled.spec,
        in_stream_order(intervals, streams),
        shown,
        streams,
        "measured",
        note=f"{Path(name).name}, step {step}",
    )
