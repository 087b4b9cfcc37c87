"""The trace file of `schedc run --trace`: its schema (docs/trace.md), in one place, both ways.

Written:
    chrome_events(rank, streams, spans, steps) -> [event]   one rank's events (the executor's)
    trace_file(events, schedule)               -> dict      the file's JSON, every rank's events
    chrome_trace(timeline)                     -> dict      a Timeline written the same way
Read:
    load(path)                             -> Trace      the file, checked, its op spans kept
    validate(data, path)                   -> Trace      the same, from parsed JSON
    measured(compiled, trace, step, ranks) -> Timeline   one step's spans, per rank and stream

A trace holds Chrome "X" events named by IR text (`bwd[h.3]@mb1`) with pid = rank and
args.step / args.stream, "M" events naming each rank's process and threads (one thread per
stream, a `steps` track, a `probe` thread), and otherData.schedule. The event constructors
below are the only place an event's shape is spelled out; the executor, the probe
(exec/probe.py) and `chrome_trace` write through them. Nothing here imports torch.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import re
import stat
from dataclasses import dataclass, replace
from pathlib import Path

from schedc.analysis.simulate import Interval, Timeline, in_stream_order
from schedc.compiler import Compiled
from schedc.errors import UserError
from schedc.ir.op import Op, OpSyntaxError


class TraceError(UserError):
    """The trace cannot be read, or does not belong to the schedule it is drawn with."""


@dataclass(frozen=True, slots=True)
class TracedOp:
    """One op span of a trace: when a rank ran it, on which stream, in which step."""

    rank: int
    step: int
    stream: str
    op: Op
    start: float  # seconds, the trace's clock
    end: float
    index: int = -1  # the event's position in traceEvents, for messages


@dataclass(frozen=True)
class Trace:
    """A trace as schedc reads it: the op spans (every "X" event named by an op, its stream
    resolved), the probe events of `--probe`, and the schedule it names. Every other event
    is dropped on reading, so a 256 MiB file of 1.7 million spans is held in about 350 MB
    (docs/benchmarks.md, "Large traces")."""

    spans: list[TracedOp]
    probes: list[tuple[int, dict]]  # (index in traceEvents, event) with cat "probe"
    schedule: str | None = None  # otherData.schedule: the file the run compiled


MAX_BYTES = 256 << 20  # the largest trace file schedc reads (~1.7M events of ~155 bytes)
MAX_US = 1e18  # ts and dur bound, microseconds (31,700 years; epoch-based clocks fit)
MAX_RANK = 2**31 - 1
CHUNK = 4 << 20  # bytes read at a time by the streaming reader
PROBE = "probe"  # the category of probe events, the only "X" events kept whatever their name


# -- writing: what `schedc run --trace` writes (docs/trace.md, "What a run writes") ----------------


@dataclass
class Timed:
    """One op's time on its stream, for the trace (ns, CLOCK_MONOTONIC)."""

    op: Op
    stream: str
    start: int
    end: int
    issue: int = 0  # host time the op was issued (collectives)


def chrome_events(
    rank: int, streams, spans: list[tuple[int, Timed]], steps: list[tuple[int, int, int]] = ()
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


# The events, one constructor per kind. Times are microseconds on the run's clock.


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
    analysis/calibrate.py's `probes` and `compute_probes`."""
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


# -- reading ---------------------------------------------------------------------------------------


def load(path: str | Path) -> Trace:
    """The trace at `path`: a regular file of at most MAX_BYTES (its size known before a
    byte is read), checked against the schema before anything else looks at it. Every
    failure is one TraceError.

    Read as a stream: the events are decoded one at a time and only those schedc reads are
    kept (`_Reader`), so memory follows the spans, not the text. A file the stream cannot
    take in its stride (a syntax error, a schema error, an unusual envelope) is read again
    whole and judged by `validate`, so every message is the same as for the parsed JSON."""
    path = Path(path)
    with _open(path) as f:
        try:
            return _Stream(f, str(path)).trace()
        except _Unstreamable:
            f.seek(0)
            raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:  # grown since it was opened
        raise TraceError(f"{path}: larger than {MAX_BYTES >> 20} MiB; not a trace schedc reads")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise TraceError(
            f"{path}: JSON nested too deeply to read (a trace is 4 levels deep)"
        ) from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of thousands of digits
        raise TraceError(f"{path}: not JSON: {e}") from None
    return validate(data, str(path))


def _open(path: Path):
    """The file, opened for reading if it is a regular file of at most MAX_BYTES."""
    try:
        # O_NONBLOCK: opening a FIFO would wait for a writer; reading it (or /dev/zero)
        # would never end, so anything but a regular file is refused before the first read
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise TraceError(f"cannot read trace {path}: {getattr(e, 'strerror', None) or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise TraceError(f"cannot read trace {path}: not a regular file")
    if st.st_size > MAX_BYTES:
        os.close(fd)
        raise TraceError(f"{path}: larger than {MAX_BYTES >> 20} MiB; not a trace schedc reads")
    return os.fdopen(fd, "rb")


class _Unstreamable(Exception):
    """The streaming reader stops: the file is judged whole instead (`load`)."""


_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


class _Stream:
    """A trace file decoded one event at a time: the envelope (an object whose traceEvents is
    a list, or a list of events) walked by hand, each event and every other value decoded
    by json's own scanner. Anything unusual raises _Unstreamable."""

    def __init__(self, f, name: str):
        self.f, self.name = f, name
        self.text, self.pos, self.eof = "", 0, False
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.want = CHUNK

    def trace(self) -> Trace:
        reader = _Reader(self.name)
        try:
            first = self._peek()
            if first == "[":
                self._events(reader, "")
            elif first == "{":
                self._envelope(reader)
            else:
                raise _Unstreamable
            if self._peek() != "":  # extra data after the top value
                raise _Unstreamable
            return reader.trace()
        except (ValueError, RecursionError, TraceError):  # judged again, whole, by validate
            raise _Unstreamable from None

    def _envelope(self, reader: _Reader) -> None:
        self.pos += 1
        keys: set[str] = set()
        if self._peek() == "}":
            raise _Unstreamable  # no traceEvents: validate says so
        while True:
            key = self._value()
            if not isinstance(key, str) or key in keys or self._peek() != ":":
                raise _Unstreamable
            keys.add(key)
            self.pos += 1
            self._peek()
            if key == "traceEvents":
                if self._peek() != "[":
                    raise _Unstreamable
                self._events(reader, "traceEvents")
            elif key == "otherData":
                reader.other(self._value())
            else:
                self._value()
            sep = self._peek()
            self.pos += 1
            if sep == "}":
                break
            if sep != ",":
                raise _Unstreamable
        if "traceEvents" not in keys:
            raise _Unstreamable

    def _events(self, reader: _Reader, where: str) -> None:
        self.pos += 1
        if self._peek() == "]":
            self.pos += 1
            return
        i = 0
        while True:
            reader.add(i, self._value(), where)
            i += 1
            sep = self._peek()
            self.pos += 1
            if sep == "]":
                return
            if sep != ",":
                raise _Unstreamable

    def _peek(self) -> str:
        """The next character that is not whitespace ('' at the end), reading on as needed."""
        while True:
            self.pos = _WS.match(self.text, self.pos).end()
            if self.pos < len(self.text) or not self._more():
                return self.text[self.pos : self.pos + 1]

    def _value(self):
        """The JSON value at the cursor. A value must end before the text read so far does
        (or at the end of the file): `12` read so far may be the start of `1234`."""
        self._peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, self.pos)
                if end < len(self.text) or self.eof:
                    self.pos = end
                    return value
            except ValueError:
                if self.eof:
                    raise
            self._more(grow=True)

    def _more(self, grow: bool = False) -> bool:
        """Read on: the rest of the text, then up to `want` bytes (doubled each time a
        value is cut, so one long value costs linear time). False at the end of the file."""
        if self.eof:
            return False
        if grow:
            self.want *= 2
        chunk = self.f.read(self.want)
        self.eof = not chunk
        self.text = self.text[self.pos :] + self.utf8.decode(chunk, final=self.eof)
        self.pos = 0
        return not self.eof or self.pos < len(self.text)


class _Reader:
    """Events in, a Trace out: each event checked against the schema (`_event`) and kept
    only if schedc reads it; names, streams and steps shared, so a million spans of a few
    dozen ops hold a few dozen strings."""

    def __init__(self, name: str):
        self.name = name
        self.spans: list[TracedOp] = []
        self.unresolved: list[tuple[int, int, object]] = []  # (position, pid, tid)
        self.threads: dict[tuple[int, object], str] = {}
        self.probes: list[tuple[int, dict]] = []
        self.schedule: str | None = None
        self.ops: dict[str, Op | None] = {}
        self.shared: dict = {}

    def other(self, other) -> None:
        check_object(other, f"{self.name}: otherData")
        if "schedule" in other:
            _path_text(other["schedule"], f"{self.name}: otherData.schedule")
            self.schedule = other["schedule"]

    def add(self, i: int, e, where: str) -> None:
        _event(e, f"{self.name}: {where}[{i}]", self._op)
        ph = e["ph"]
        if ph == "X":
            if e.get("cat") == PROBE:
                self.probes.append((i, e))
            op = self._op(e)
            if op is None:
                return
            args = e.get("args") or {}
            stream = args.get("stream")
            if not stream:
                self.unresolved.append((len(self.spans), e["pid"], e.get("tid")))
            ts = float(e["ts"]) / 1e6
            share = self.shared.setdefault
            self.spans.append(
                TracedOp(
                    share(e["pid"], e["pid"]),
                    share(args.get("step") or 0, args.get("step") or 0),
                    share(stream, stream) if stream else "",
                    op,
                    ts,
                    ts + float(e["dur"]) / 1e6,
                    i,
                )
            )
        elif ph == "M" and e.get("name") == "thread_name":
            self.threads[(e["pid"], e["tid"])] = e["args"]["name"]

    def _op(self, e) -> Op | None:
        name = e.get("name", "")
        if name not in self.ops:
            try:
                self.ops[name] = Op.parse(name)
            except OpSyntaxError:
                self.ops[name] = None
        return self.ops[name]

    def trace(self) -> Trace:
        """The Trace, each span without args.stream given its thread's name (or the tid)."""
        for n, pid, tid in self.unresolved:
            stream = self.threads.get((pid, tid)) or str(tid)
            self.spans[n] = replace(self.spans[n], stream=self.shared.setdefault(stream, stream))
        return Trace(self.spans, self.probes, self.schedule)


# -- the schema: what schedc reads from a trace (docs/trace.md) ---------------------------------
#
# The envelope of every event (an object; `ph` a string; `name`, if present, a string) is
# checked, since it decides whether schedc uses the event. Only the events schedc uses are
# checked further, field by field: "X" events whose name is an op (`bwd[h.3]@mb1`) and "M"
# "thread_name" events. Every other event, and every field not named here, is ignored.


def validate(data, path: str) -> Trace:
    """`data` (parsed JSON) as a Trace, or TraceError naming the first bad field."""
    reader = _Reader(path)
    if isinstance(data, list):  # Chrome's JSON Array Format: the events alone
        events, where = data, ""
    else:
        if not isinstance(data, dict):
            raise TraceError(
                f"{path}: expected a JSON object with a traceEvents list (or a "
                f"list of events), got {_shown(data)}"
            )
        events, where = data.get("traceEvents"), "traceEvents"
        if not isinstance(events, list):
            raise TraceError(
                f"{path}: traceEvents: expected a list of events, got "
                f"{_shown(events) if 'traceEvents' in data else 'nothing'}"
            )
        if data.get("otherData") is not None:
            reader.other(data["otherData"])
    for i, e in enumerate(events):
        reader.add(i, e, where)
    return reader.trace()


def _event(e, at: str, op=None) -> None:
    """Check one event; `op(e)` is its op, or None (a name that is no op's)."""
    check_object(e, at)
    if not isinstance(e.get("ph"), str):
        raise TraceError(
            f'{at}.ph: expected a string (the event type, "X" or "M"), got '
            f"{_shown(e['ph']) if 'ph' in e else 'nothing'}"
        )
    if "name" in e and not isinstance(e["name"], str):
        raise TraceError(f"{at}.name: expected a string, got {_shown(e['name'])}")
    if e["ph"] == "X" and (op or _op)(e) is not None:
        _rank(e, "pid", at)
        _thread(e, at)
        check_time(e, "ts", at)
        check_time(e, "dur", at)
        if e["ts"] + e["dur"] > MAX_US:
            raise TraceError(f"{at}: ts + dur, the span's end, is past {MAX_US:g} us")
        args = e.get("args")
        if args is not None:
            check_object(args, f"{at}.args")
            step = args.get("step")
            if step is not None and not (is_int(step) and 0 <= step <= MAX_RANK):
                raise TraceError(f"{at}.args.step: expected an integer >= 0, got {_shown(step)}")
            if args.get("stream") is not None:
                _name(args["stream"], f"{at}.args.stream")
    elif e["ph"] == "M" and e.get("name") == "thread_name":
        _rank(e, "pid", at)
        _thread(e, at, required=True)
        args = e.get("args")
        check_object(args, f"{at}.args", present="args" in e)
        _name(args.get("name"), f"{at}.args.name", present="name" in args)


def _op(e) -> Op | None:
    try:
        return Op.parse(e.get("name", ""))
    except OpSyntaxError:
        return None


def check_object(v, at: str, present: bool = True) -> None:
    if not isinstance(v, dict):
        raise TraceError(f"{at}: expected an object, got {_shown(v) if present else 'nothing'}")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rank(e, key: str, at: str) -> None:
    v = e.get(key)
    if not (is_int(v) and 0 <= v <= MAX_RANK):
        raise TraceError(
            f"{at}.{key}: expected a rank, an integer >= 0, got "
            f"{_shown(v) if key in e else 'nothing'}"
        )


def _thread(e, at: str, required: bool = False) -> None:
    """`tid`: schedc writes the stream's index; a string names a thread too (Chrome allows)."""
    v = e.get("tid")
    if v is None and not required and "tid" not in e:
        return
    if not ((is_int(v) and 0 <= v <= MAX_RANK) or (isinstance(v, str) and len(v) <= 200)):
        raise TraceError(
            f"{at}.tid: expected an integer >= 0 or a string, got "
            f"{_shown(v) if 'tid' in e else 'nothing'}"
        )


def check_time(e, key: str, at: str) -> None:
    v = e.get(key)
    # the range first: math.isfinite(10**400) overflows converting the int to a float
    if not (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and 0 <= v <= MAX_US
        and math.isfinite(v)
    ):
        raise TraceError(
            f"{at}.{key}: expected a finite number >= 0 (microseconds, at most "
            f"{MAX_US:g}), got {_shown(v) if key in e else 'nothing'}"
        )


def _name(v, at: str, present: bool = True) -> None:
    if not (isinstance(v, str) and 0 < len(v) <= 200):
        raise TraceError(
            f"{at}: expected a name, a string of 1 to 200 characters, got "
            f"{_shown(v) if present else 'nothing'}"
        )


def _path_text(v, at: str) -> None:
    if not (isinstance(v, str) and 0 < len(v) <= 4096 and "\0" not in v):
        raise TraceError(f"{at}: expected a file name, got {_shown(v)}")


def _printable(text: str) -> str:
    """Text from the trace, its lone surrogates (JSON allows "\\ud800") escaped: a message
    must encode to UTF-8 wherever it is printed."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _shown(v) -> str:
    """A JSON value as the message shows it: scalars in JSON spelling (clipped), not contents."""
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, str):
        return json.dumps(v[:40] + ("..." if len(v) > 40 else ""))
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} digits)"


# -- against the schedule, and as a Timeline -------------------------------------------------------


def against(compiled: Compiled, chosen: list[TracedOp], name: str) -> None:
    """Every span's rank, stream and op must be the schedule's: a trace of another schedule,
    or one edited by hand, is refused here, naming the event, not deep in the drawing."""
    world, where = compiled.spec.world, f"{name}: traceEvents"
    planned: dict[int, set] = {}
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
                f"{where}[{s.index}]: rank {s.rank} ran {_printable(str(s.op))}, which "
                f"{compiled.source.path}'s plan does not hold; was the trace recorded from "
                "another schedule or with --model?"
            )


def steps(trace: Trace) -> list[int]:
    return sorted({s.step for s in trace.spans})


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
