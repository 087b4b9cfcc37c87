"""A trace file read: `load` opens it (a regular file of at most MAX_BYTES), decodes it as
a stream (`_Stream`, one event at a time, so memory follows the spans, not the text) and,
when the stream cannot take it in its stride, judges it whole with `validate`."""

from __future__ import annotations

import codecs
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

from schedc.analysis.trace.read import Events, Reader, judge
from schedc.analysis.trace.schema import MAX_BYTES, Trace, TraceError

CHUNK = 4 << 20  # bytes read at a time by the streaming reader
T = TypeVar("T")


def load(path: str | Path) -> Trace:
    """The trace at `path`: a regular file of at most MAX_BYTES (its size known before a
    byte is read), checked against the schema before anything else looks at it. Every
    failure is one TraceError.

    Read as a stream: the events are decoded one at a time and only those schedc reads are
    kept (`Reader`), so memory follows the spans, not the text. A file the stream cannot
    take in its stride (a syntax error, a schema error, an unusual envelope) is read again
    whole and judged by `validate`, so every message is the same as for the parsed JSON."""
    name = str(Path(path))
    return read(path, lambda: Reader(name))


def read(path: str | Path, events: Callable[[], Events[T]]) -> T:
    """The file at `path` read as `load` reads it, into `events()` (a fresh one for the
    reading whole): every reader of a trace file, of whatever events, is bounded alike."""
    path = Path(path)
    with _open(path) as f:
        try:
            return _Stream(f, str(path)).read(events())
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
    return judge(data, str(path), events())


def _open(path: Path) -> IO[bytes]:
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

    def __init__(self, f: IO[bytes], name: str):
        self.f, self.name = f, name
        self.text, self.pos, self.eof = "", 0, False
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.want = CHUNK

    def trace(self) -> Trace:
        return self.read(Reader(self.name))

    def read(self, reader: Events[T]) -> T:
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
        except (ValueError, RecursionError, TraceError):  # judged again, whole, by `judge`
            raise _Unstreamable from None

    def _envelope(self, reader: Events) -> None:
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
            self._member(reader, key)
            if self._separator("}"):
                break
        if "traceEvents" not in keys:
            raise _Unstreamable

    def _member(self, reader: Events, key: str) -> None:
        """The value of the envelope's `key`: the events, otherData, or one skipped."""
        if key == "traceEvents":
            if self._peek() != "[":
                raise _Unstreamable
            self._events(reader, "traceEvents")
        elif key == "otherData":
            reader.other(self._value())
        else:
            self._value()

    def _events(self, reader: Events, where: str) -> None:
        self.pos += 1
        if self._peek() == "]":
            self.pos += 1
            return
        i = 0
        while True:
            reader.add(i, self._value(), where)
            i += 1
            if self._separator("]"):
                return

    def _separator(self, close: str) -> bool:
        """Past the `,` after a member (False) or the `close` that ends the container (True)."""
        sep = self._peek()
        self.pos += 1
        if sep == close:
            return True
        if sep != ",":
            raise _Unstreamable
        return False

    def _peek(self) -> str:
        """The next character that is not whitespace ('' at the end), reading on as needed."""
        while True:
            space = _WS.match(self.text, self.pos)  # matches everywhere: `*` takes none too
            self.pos = space.end() if space else self.pos
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
