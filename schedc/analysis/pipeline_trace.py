"""A pipeline run's trace: each rank's items as they ran, written, read back and measured.

    trace_file(spans, schedule, pp, dp)      -> dict      the JSON `schedc run --trace` writes
    load(path, programs, dp)                 -> PipeTrace  read and checked against the programs
    measure(trace, programs, step)           -> Measured   one step: per item start/end, bubble
    measured.costs()                         -> {(kind, stage): mean ms}   to simulate with

The file is a Chrome/Perfetto trace (docs/pipeline.md "Trace"): one "X" event per item of
each rank's program and step, named by its IR text (`F[s1]@mb0`, `SEND_F[s0]@mb1+RECV_B[s0]@mb0`),
`pid` the global rank, `ts`/`dur` in microseconds of the host's monotonic clock (one clock
for the ranks of one host), `args` {step, item, pp_rank, replica}; `otherData` {format:
"schedc-pipeline", schedule, pp, dp}. A compute item's span starts once the receive it reads
has arrived, so its duration is compute alone; a transfer item's is its posting. It is read
by the trace file's one reader (analysis/trace/stream.py `read`, bounded as for a DP trace)
into `_Items`, which checks each span against the programs.

The measured bubble is the simulator's (passes/pipeline_sim.py): a step runs from the
earliest first item to the latest last item over the pipeline ranks of one replica, and a
rank's bubble is the share of that it was not computing. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from statistics import fmean, median

from schedc.analysis.trace.read import judge
from schedc.analysis.trace.schema import (
    MAX_RANK,
    TraceError,
    check_envelope,
    check_object,
    check_span,
    printable,
    shown,
)
from schedc.analysis.trace.stream import read
from schedc.ir.op import Kind
from schedc.ir.pipeline import Programs, actions, backward_kind, format_item, reader
from schedc.passes.pipeline_sim import Costs

FORMAT = "schedc-pipeline"


class PipeTraceError(TraceError):
    """The trace is not of the pipeline it is drawn with (TraceError: it cannot be read)."""


@dataclass(frozen=True)
class ItemSpan:
    """One item of a rank's program in one step, seconds on the host's monotonic clock."""

    rank: int  # global rank
    step: int
    item: int
    start: float
    end: float


def trace_file(spans: list[ItemSpan], schedule: str, programs: Programs, dp: int) -> dict:
    """Every rank's spans as a Chrome trace (global rank r runs pipeline rank r // dp)."""
    events: list[dict] = []
    for r in sorted({s.rank for s in spans}):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
    for s in spans:
        pp_rank, replica = divmod(s.rank, dp)
        events.append(
            {
                "ph": "X",
                "name": format_item(programs[pp_rank][s.item]),
                "cat": "pipeline",
                "pid": s.rank,
                "tid": 0,
                "ts": round(s.start * 1e6, 3),
                "dur": round((s.end - s.start) * 1e6, 3),
                "args": {"step": s.step, "item": s.item, "pp_rank": pp_rank, "replica": replica},
            }
        )
    pp = len(programs)
    other = {"format": FORMAT, "schedule": schedule, "pp": pp, "dp": dp}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


@dataclass(frozen=True)
class PipeTrace:
    schedule: str
    pp: int
    dp: int
    spans: list[ItemSpan]

    @property
    def steps(self) -> list[int]:
        return sorted({s.step for s in self.spans})


def load(path: str, programs: Programs, dp: int) -> PipeTrace:
    """The trace at `path`, every span checked against `programs` (the item at its index
    must be the one named), or a TraceError naming the first thing that is not. Read by the
    trace file's one reader (analysis/trace/stream.py): a regular file of bounded size,
    streamed, its JSON's depth and numbers bounded, each failure one line naming the file."""
    return read(path, lambda: _Items(str(Path(path)), programs, dp))


def validate(data, path: str, programs: Programs, dp: int) -> PipeTrace:
    """`data` (parsed JSON) as a PipeTrace, or a TraceError naming the first bad field."""
    return judge(data, path, _Items(path, programs, dp))


class _Items:
    """A pipeline trace's events, as the trace reader gives them (analysis/trace/read.py
    `Events`): otherData names the pipeline the trace is of; each "X" event is a span (the
    schema's `check_span`: rank, times, step) of an item of `programs`, named by its text."""

    def __init__(self, path: str, programs: Programs, dp: int):
        self.path, self.programs, self.dp = path, programs, dp
        self.schedule: str | None = None  # None until otherData names a pipeline trace
        self.spans: list[ItemSpan] = []

    def other(self, other) -> None:
        check_object(other, f"{self.path}: otherData")
        if other.get("format") != FORMAT:
            raise self._not_pipeline()
        pp = len(self.programs)
        if (other.get("pp"), other.get("dp")) != (pp, self.dp):
            raise PipeTraceError(
                f"{self.path}: a trace of {shown(other.get('pp'))} pipeline ranks x dp "
                f"{shown(other.get('dp'))}, drawn with a schedule of {pp} x dp {self.dp}"
            )
        schedule = other.get("schedule", "")
        self.schedule = schedule if isinstance(schedule, str) else ""

    def add(self, i: int, e, where: str) -> None:
        at = f"{self.path}: {where}[{i}]"
        check_envelope(e, at)
        if e["ph"] == "X":
            check_span(e, at)
            self.spans.append(self._span(e, at))

    def _span(self, e: dict, at: str) -> ItemSpan:
        args = e["args"] if isinstance(e.get("args"), dict) else {}
        rank, step, item = e["pid"], _index(args, "step", at), _index(args, "item", at)
        pp_rank = rank // self.dp
        program = self.programs.get(pp_rank)
        if program is None or item >= len(program):
            raise PipeTraceError(f"{at}: rank {rank} has no item {item} in the schedule")
        want = format_item(program[item])
        if e.get("name") != want:
            raise PipeTraceError(
                f"{at}.name: {_said(e.get('name'))}, but item {item} of pipeline rank {pp_rank} "
                f"is {want}; was the trace recorded from another schedule?"
            )
        start = float(e["ts"]) / 1e6
        return ItemSpan(rank, step, item, start, start + float(e["dur"]) / 1e6)

    def trace(self) -> PipeTrace:
        if self.schedule is None:
            raise self._not_pipeline()
        if not self.spans:
            raise PipeTraceError(f"{self.path}: no item spans")
        return PipeTrace(self.schedule, len(self.programs), self.dp, self.spans)

    def _not_pipeline(self) -> PipeTraceError:
        return PipeTraceError(
            f"{self.path}: not a pipeline trace (otherData.format is not {FORMAT!r}); was it "
            "written by `schedc run --trace` of a pipeline schedule?"
        )


def _index(args: dict, key: str, at: str) -> int:
    """args.step or args.item: an integer >= 0."""
    v = args.get(key)
    if not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_RANK):
        raise PipeTraceError(f"{at}.args.{key}: expected an integer >= 0, got {shown(v)}")
    return v


def _said(name) -> str:
    """An event's name as a message quotes it: its repr, clipped."""
    if not isinstance(name, str):
        return "no name"
    return printable(repr(name if len(name) <= 60 else name[:40] + "..."))


@dataclass(frozen=True)
class Measured:
    """One step of one replica, in ms from its start: each item's (start, end) per
    pipeline rank, compute time and bubble per rank."""

    programs: Programs
    times: dict[tuple[int, int], tuple[float, float]]  # (pipeline rank, item) -> ms
    step: float

    @property
    def busy(self) -> dict[int, float]:
        out = {r: 0.0 for r in self.programs}
        for (r, i), (a, b) in self.times.items():
            if not self.programs[r][i][0].kind.is_p2p:
                out[r] += b - a
        return out

    @property
    def bubble(self) -> dict[int, float]:
        return {r: (self.step - b) / self.step if self.step else 0.0 for r, b in self.busy.items()}

    def durations(self) -> dict[tuple[Kind, int], list[float]]:
        """Every compute item's duration (ms), by kind and stage."""
        seen: dict[tuple[Kind, int], list[float]] = {}
        for (r, i), (a, b) in sorted(self.times.items()):
            act = self.programs[r][i][0]
            if not act.kind.is_p2p:
                seen.setdefault((act.kind, act.stage), []).append(b - a)
        return dict(sorted(seen.items()))

    def costs(self) -> dict[tuple[Kind, int], float]:
        """Mean duration (ms) of each compute kind per stage: the simulator's `Costs.measured`."""
        return {k: fmean(v) for k, v in self.durations().items()}

    def postings(self) -> dict[int, list[float]]:
        """Every transfer item's posting time (ms), by pipeline rank."""
        out: dict[int, list[float]] = {r: [] for r in self.programs}
        for (r, i), (a, b) in sorted(self.times.items()):
            if self.programs[r][i][0].kind.is_p2p:
                out[r].append(b - a)
        return out

    def post(self) -> float:
        """Mean time (ms) a rank spent posting a transfer item."""
        spent = [t for v in self.postings().values() for t in v]
        return fmean(spent) if spent else 0.0

    def gap(self) -> float:
        """Median host time (ms) from an item's end to the next one's start, over the items
        that wait for no receive: the executor's own time between items."""
        reads = {
            reader(a, self._back)
            for p in self.programs.values()
            for it in p
            for a in it
            if a.kind.is_p2p and not a.kind.is_send
        }
        gaps = [
            self.times[(r, i)][0] - self.times[(r, i - 1)][1]
            for r, p in self.programs.items()
            for i in range(1, len(p))
            if p[i][0] not in reads
        ]
        return median(gaps) if gaps else 0.0

    @cached_property
    def _back(self) -> Kind:
        """The programs' backward kind, found once (`reader` asks it for every receive)."""
        return backward_kind(a for p in self.programs.values() for a in actions(p))

    def calibrated(self) -> Costs:
        """The simulator's costs as measured here: each kind per stage, latency, posting
        (each rank's own mean: which transfers a rank groups and when differs), gap."""
        posts = {r: fmean(v) for r, v in self.postings().items() if v}
        return Costs.measured(self.costs(), self.latency(), self.post(), self.gap(), posts)

    def latency(self) -> float:
        """Mean of `latencies`. The mean, not the median: a step's length is a sum of the
        latencies on its critical path, and these have a long tail (measured on 2 ranks:
        most under 0.15 ms, one to four a step of 1-6 ms), which the median drops."""
        samples = self.latencies()
        return fmean(samples) if samples else 0.0

    def latencies(self) -> list[float]:
        """Time (ms) from the later of a transfer's two items starting to be posted until its
        reader ran (the simulator's latency: posting included, as gloo writes in the
        posting), over the readers that waited for it: the transport's latency, and on a
        shared CPU the reader's wake-up. A reader waited if it started more than `waited` after its
        previous item ended; one that did not tells nothing of the transfer (it may have
        arrived long before), and counting it (as this did until 2026-12-03) put waits of
        10-15 ms into interleaved schedules' latency, whose receives are posted early."""
        at = {a: (r, i) for r, p in self.programs.items() for i, it in enumerate(p) for a in it}
        sends = {a.tag: at[a] for a in at if a.kind.is_send}
        waited = self.waited()
        samples = []
        for a, (r, i) in sorted(at.items(), key=lambda e: e[1]):
            if not a.kind.is_p2p or a.kind.is_send:
                continue
            k = at[reader(a, self._back)][1]
            start, before = self.times[(r, k)][0], self.times[(r, k - 1)][1]
            posted = max(self.times[sends[a.tag]][0], self.times[(r, i)][0])
            if start - before > waited and start > posted:
                samples.append(start - posted)
        return samples

    def waited(self) -> float:
        """How long (ms) after its previous item a reader must start to have waited: three
        times the executor's own time between items, and at least 20 us (on a 2-core CPU
        the gap is 6-9 us, and readers that found their transfer arrived start within 20 us;
        those that waited, from 30 us to milliseconds)."""
        return max(3 * self.gap(), 0.02)


def measure(
    spans: list[ItemSpan], programs: Programs, step: int, dp: int = 1, replica: int = 0
) -> Measured:
    """Step `step` of `replica` (its pipeline ranks' spans), every item present."""
    mine = [s for s in spans if s.step == step and s.rank % dp == replica]
    want = sum(len(p) for p in programs.values())
    if len({(s.rank, s.item) for s in mine}) != want:
        raise PipeTraceError(
            f"step {step} of replica {replica}: {len(mine)} item spans, the programs have {want}"
        )
    t0 = min(s.start for s in mine)
    times = {(s.rank // dp, s.item): ((s.start - t0) * 1e3, (s.end - t0) * 1e3) for s in mine}
    return Measured(programs, times, max(s.end - t0 for s in mine) * 1e3)
