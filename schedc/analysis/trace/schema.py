"""What a trace holds once read (`Trace`, `TracedOp`), its bounds, and the checks of the
fields schedc reads from it (docs/trace.md).

The envelope of every event (an object; `ph` a string; `name`, if present, a string) is
checked, since it decides whether schedc uses the event. Only the events schedc uses are
checked further, field by field: "X" events whose name is an op (`bwd[h.3]@mb1`) and "M"
"thread_name" events. Every other event, and every field not named here, is ignored.
Every failure is one TraceError naming the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

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
PROBE = "probe"  # the category of probe events, the only "X" events kept whatever their name


def check_event(e, at: str, op: Callable[[dict], Op | None] | None = None) -> None:
    """Check one event; `op(e)` is its op, or None (a name that is no op's)."""
    check_envelope(e, at)
    if e["ph"] == "X" and (op or _op)(e) is not None:
        check_span(e, at)
    elif e["ph"] == "M" and e.get("name") == "thread_name":
        _rank(e, "pid", at)
        _thread(e, at, required=True)
        args = e.get("args")
        check_object(args, f"{at}.args", present="args" in e)
        _name(args.get("name"), f"{at}.args.name", present="name" in args)


def check_envelope(e, at: str) -> None:
    """What every event must be, whoever reads it: an object, `ph` a string, `name` (if
    present) a string."""
    check_object(e, at)
    if not isinstance(e.get("ph"), str):
        raise TraceError(
            f'{at}.ph: expected a string (the event type, "X" or "M"), got '
            f"{shown(e['ph']) if 'ph' in e else 'nothing'}"
        )
    if "name" in e and not isinstance(e["name"], str):
        raise TraceError(f"{at}.name: expected a string, got {shown(e['name'])}")


def check_span(e: dict, at: str) -> None:
    """A span (an op's, or a pipeline item's): its rank, thread, times, and the step and
    stream in its args."""
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
            raise TraceError(f"{at}.args.step: expected an integer >= 0, got {shown(step)}")
        if args.get("stream") is not None:
            _name(args["stream"], f"{at}.args.stream")


def _op(e) -> Op | None:
    """The plan op a span names; None for any other span (a pipeline trace's stage ops are
    analysis/pipeline_trace.py's)."""
    try:
        op = Op.parse(e.get("name", ""))
    except OpSyntaxError:
        return None
    return None if op.kind.on_stage else op


def check_object(v, at: str, present: bool = True) -> None:
    if not isinstance(v, dict):
        raise TraceError(f"{at}: expected an object, got {shown(v) if present else 'nothing'}")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rank(e, key: str, at: str) -> None:
    v = e.get(key)
    if not (is_int(v) and 0 <= v <= MAX_RANK):
        raise TraceError(
            f"{at}.{key}: expected a rank, an integer >= 0, got "
            f"{shown(v) if key in e else 'nothing'}"
        )


def _thread(e, at: str, required: bool = False) -> None:
    """`tid`: schedc writes the stream's index; a string names a thread too (Chrome allows)."""
    v = e.get("tid")
    if v is None and not required and "tid" not in e:
        return
    if not ((is_int(v) and 0 <= v <= MAX_RANK) or (isinstance(v, str) and len(v) <= 200)):
        raise TraceError(
            f"{at}.tid: expected an integer >= 0 or a string, got "
            f"{shown(v) if 'tid' in e else 'nothing'}"
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
            f"{MAX_US:g}), got {shown(v) if key in e else 'nothing'}"
        )


def _name(v, at: str, present: bool = True) -> None:
    if not (isinstance(v, str) and 0 < len(v) <= 200):
        raise TraceError(
            f"{at}: expected a name, a string of 1 to 200 characters, got "
            f"{shown(v) if present else 'nothing'}"
        )


def check_file_name(v, at: str) -> None:
    """otherData.schedule: a file name (not empty, no NUL, at most 4096 characters)."""
    if not (isinstance(v, str) and 0 < len(v) <= 4096 and "\0" not in v):
        raise TraceError(f"{at}: expected a file name, got {shown(v)}")


def printable(text: str) -> str:
    """Text from the trace, its lone surrogates (JSON allows "\\ud800") escaped: a message
    must encode to UTF-8 wherever it is printed."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(v) -> str:
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
