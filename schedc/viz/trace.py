"""Measured timelines from `schedc run --trace` files, and the cost model fitted to them.

    load(path)                             -> Trace      the file, checked, its op spans kept
    measured(compiled, trace, step, ranks) -> Timeline   one step's spans, per rank and stream
    chrome_trace(timeline)                 -> dict       a timeline as a trace file's JSON
    calibrate(compiled, trace)             -> Fit        compute throughput from fwd/bwd spans,
                                                         bandwidth and latency from collectives

A trace holds Chrome "X" events named by IR text (`bwd[h.3]@mb1`) with pid = rank and
args.step / args.stream; `schedc.exec.executor.chrome_events` writes them. Nothing here
imports torch.
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

from schedc.compiler import Compiled
from schedc.ir.op import Kind, Op, OpSyntaxError
from schedc.viz.cost import (
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
from schedc.viz.simulate import Interval, Timeline, in_stream_order
from schedc.viz.units import fmt_rate, fmt_time


class TraceError(ValueError):
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
        _object(other, f"{self.name}: otherData")
        if "schedule" in other:
            _path_text(other["schedule"], f"{self.name}: otherData.schedule")
            self.schedule = other["schedule"]

    def add(self, i: int, e, where: str) -> None:
        _event(e, f"{self.name}: {where}[{i}]", self._op)
        ph = e["ph"]
        if ph == "X":
            if e.get("cat") == "probe":
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
    _object(e, at)
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
        _time(e, "ts", at)
        _time(e, "dur", at)
        if e["ts"] + e["dur"] > MAX_US:
            raise TraceError(f"{at}: ts + dur, the span's end, is past {MAX_US:g} us")
        args = e.get("args")
        if args is not None:
            _object(args, f"{at}.args")
            step = args.get("step")
            if step is not None and not (_is_int(step) and 0 <= step <= MAX_RANK):
                raise TraceError(f"{at}.args.step: expected an integer >= 0, got {_shown(step)}")
            if args.get("stream") is not None:
                _name(args["stream"], f"{at}.args.stream")
    elif e["ph"] == "M" and e.get("name") == "thread_name":
        _rank(e, "pid", at)
        _thread(e, at, required=True)
        args = e.get("args")
        _object(args, f"{at}.args", present="args" in e)
        _name(args.get("name"), f"{at}.args.name", present="name" in args)


def _op(e) -> Op | None:
    try:
        return Op.parse(e.get("name", ""))
    except OpSyntaxError:
        return None


def _object(v, at: str, present: bool = True) -> None:
    if not isinstance(v, dict):
        raise TraceError(f"{at}: expected an object, got {_shown(v) if present else 'nothing'}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rank(e, key: str, at: str) -> None:
    v = e.get(key)
    if not (_is_int(v) and 0 <= v <= MAX_RANK):
        raise TraceError(
            f"{at}.{key}: expected a rank, an integer >= 0, got "
            f"{_shown(v) if key in e else 'nothing'}"
        )


def _thread(e, at: str, required: bool = False) -> None:
    """`tid`: schedc writes the stream's index; a string names a thread too (Chrome allows)."""
    v = e.get("tid")
    if v is None and not required and "tid" not in e:
        return
    if not ((_is_int(v) and 0 <= v <= MAX_RANK) or (isinstance(v, str) and len(v) <= 200)):
        raise TraceError(
            f"{at}.tid: expected an integer >= 0 or a string, got "
            f"{_shown(v) if 'tid' in e else 'nothing'}"
        )


def _time(e, key: str, at: str) -> None:
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
        if kind is None or not all(_is_int(v) for v in (nbytes, ranks, rep)):
            raise TraceError(f"{at}.args: a probe needs kind, bytes, ranks and rep")
        if not (0 < nbytes <= 1 << 40 and 2 <= ranks <= MAX_RANK):
            raise TraceError(f"{at}.args: bytes {nbytes} or ranks {ranks} out of range")
        _time(e, "ts", at)
        _time(e, "dur", at)
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
        if not (isinstance(layer, str) and _is_int(micro) and _is_int(rep)):
            raise TraceError(f"{at}.args: a compute probe needs kind, layer, micro and rep")
        if not 0 < micro <= MAX_RANK:
            raise TraceError(f"{at}.args: micro {micro} out of range")
        _time(e, "dur", at)
        timed.setdefault((Op(kind, layer), micro), []).append(float(e["dur"]) / 1e6)
    return [(op, micro, _median(ts)) for (op, micro), ts in sorted(timed.items(), key=str)]


def _probe_events(trace: Trace, name: str):
    """(event, where, args) of every probe event, args checked to be an object."""
    for i, e in trace.probes:
        at = f"{name}: traceEvents[{i}]"
        args = e.get("args")
        _object(args, f"{at}.args", present="args" in e)
        yield e, at, args


def _against(compiled: Compiled, chosen: list[TracedOp], name: str) -> None:
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
    _against(compiled, chosen, name)
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


def chrome_trace(tl: Timeline, step: int = 0, path: str = "") -> dict:
    """A timeline written the way `schedc run --trace` writes one (us, pid = rank)."""
    events = []
    for r in tl.ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        for t, s in enumerate(tl.streams):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": r, "tid": t, "args": {"name": s}}
            )
    tid = {s: t for t, s in enumerate(tl.streams)}
    for r in tl.ranks:  # the step's slice on the steps track, as the executor writes it
        mine = [i for i in tl.intervals if i.rank == r]
        start = min((i.start for i in mine), default=0.0)
        events += [
            {
                "name": "thread_name",
                "ph": "M",
                "pid": r,
                "tid": len(tid),
                "args": {"name": "steps"},
            },
            {
                "name": f"step {step}",
                "ph": "X",
                "pid": r,
                "tid": len(tid),
                "ts": start * 1e6,
                "dur": (max((i.end for i in mine), default=0.0) - start) * 1e6,
                "cat": "step",
                "args": {"step": step},
            },
        ]
    for i in tl.intervals:
        ev = {
            "name": str(i.op),
            "ph": "X",
            "pid": i.rank,
            "tid": tid[i.stream],
            "ts": i.start * 1e6,
            "dur": i.length * 1e6,
            "cat": "collective" if i.op.is_collective else "compute",
            "args": {"step": step, "stream": i.stream},
        }
        if i.op.is_collective:
            ev["args"]["launch_us"] = i.start * 1e6
            ev["args"]["complete_us"] = i.end * 1e6
        events.append(ev)
    trace: dict = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path:
        trace["otherData"] = {"schedule": path}
    return trace


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
    _against(compiled, used, name)
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
