"""Events in, a Trace out: `validate` judges parsed JSON, `Reader` each event as it comes
(the streaming reader, trace/stream.py, feeds it the same events one at a time).

`judge` is the envelope's reading for any `Events`: a pipeline trace (analysis/
pipeline_trace.py) is the same file format, read by the same reader into its own events."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, TypeVar

from schedc.analysis.trace.schema import (
    PROBE,
    Trace,
    TracedOp,
    TraceError,
    check_event,
    check_file_name,
    check_object,
    shown,
)
from schedc.ir.op import Op, OpSyntaxError

T = TypeVar("T", covariant=True)


class Events(Protocol[T]):
    """What a trace's events are read into: otherData, each event in order, then the result.
    Each method raises TraceError (or a subclass) at the first thing it does not take."""

    def other(self, other) -> None: ...

    def add(self, i: int, e, where: str) -> None: ...

    def trace(self) -> T: ...


def validate(data, path: str) -> Trace:
    """`data` (parsed JSON) as a Trace, or TraceError naming the first bad field."""
    return judge(data, path, Reader(path))


def judge(data, path: str, reader: Events[T]) -> T:
    """`data` (parsed JSON) read into `reader`: otherData first, then every event."""
    events, where = _events_of(data, path, reader)
    for i, e in enumerate(events):
        reader.add(i, e, where)
    return reader.trace()


def _events_of(data, path: str, reader: Events) -> tuple[list, str]:
    """The events of a trace and where they are (`traceEvents`, or "" for a bare list);
    the envelope's otherData goes to `reader`."""
    if isinstance(data, list):  # Chrome's JSON Array Format: the events alone
        return data, ""
    if not isinstance(data, dict):
        raise TraceError(
            f"{path}: expected a JSON object with a traceEvents list (or a "
            f"list of events), got {shown(data)}"
        )
    events = data.get("traceEvents")
    if not isinstance(events, list):
        raise TraceError(
            f"{path}: traceEvents: expected a list of events, got "
            f"{shown(events) if 'traceEvents' in data else 'nothing'}"
        )
    if data.get("otherData") is not None:
        reader.other(data["otherData"])
    return events, "traceEvents"


class Reader:
    """Events in, a Trace out: each event checked against the schema (`check_event`) and
    kept only if schedc reads it; names, streams and steps shared, so a million spans of a
    few dozen ops hold a few dozen strings."""

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
            check_file_name(other["schedule"], f"{self.name}: otherData.schedule")
            self.schedule = other["schedule"]

    def add(self, i: int, e, where: str) -> None:
        check_event(e, f"{self.name}: {where}[{i}]", self._op)
        ph = e["ph"]
        if ph == "X":
            if e.get("cat") == PROBE:
                self.probes.append((i, e))
            op = self._op(e)
            if op is not None:
                self._span(i, e, op)
        elif ph == "M" and e.get("name") == "thread_name":
            self.threads[(e["pid"], e["tid"])] = e["args"]["name"]

    def _span(self, i: int, e: dict, op: Op) -> None:
        """Keep an op span; one without args.stream is resolved by its thread at the end."""
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

    def _op(self, e) -> Op | None:
        name = e.get("name", "")
        if name not in self.ops:
            try:
                op: Op | None = Op.parse(name)
            except OpSyntaxError:
                op = None
            self.ops[name] = None if op is None or op.kind.on_stage else op
        return self.ops[name]

    def trace(self) -> Trace:
        """The Trace, each span without args.stream given its thread's name (or the tid)."""
        for n, pid, tid in self.unresolved:
            stream = self.threads.get((pid, tid)) or str(tid)
            self.spans[n] = replace(self.spans[n], stream=self.shared.setdefault(stream, stream))
        return Trace(self.spans, self.probes, self.schedule)
