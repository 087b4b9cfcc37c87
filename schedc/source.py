"""Source text and the spans that point into it.

Every diagnostic carries a Span, so the first thing the compiler does is hold the text in
a form that can answer "what is on line 12" and "where is byte 340".
"""

from __future__ import annotations

import bisect
import codecs
import os
import stat
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

MAX_SOURCE_BYTES = 1 << 20  # a schedule is a page of text; anything larger is a mistake


def _newlines(text: str) -> str:
    """CRLF (Windows) and a lone CR (classic Mac OS) both end a line: made "\\n" once, here,
    so that line numbers, columns and the lines an excerpt prints all count the same way."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


class NotRegularFile(OSError):
    """A path that names a directory, FIFO, device or socket: nothing schedc reads."""

    def __init__(self, path: str | os.PathLike[str], mode: int):
        self.kind = file_kind(mode)
        super().__init__(f"it is {self.kind}, not a regular file")
        self.strerror = str(self)
        self.filename = str(path)


def file_kind(mode: int) -> str:
    """What a st_mode names, as a message says it."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return kind
    return "not a regular file"


# O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one (the
# fstat below then refuses it); on a regular file the flag changes nothing. O_NOCTTY: a
# terminal device named by mistake never becomes the controlling terminal.
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


def read_limited(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file `path`, at most `limit + 1` of them.

    A result longer than `limit` means the file is over the limit: the limit holds on the
    bytes actually read, not on st_size, which is 0 for /dev/zero, a FIFO or a /proc file.
    Anything but a regular file raises NotRegularFile before a byte is read; the type is
    taken with fstat of the open descriptor, so a path swapped for a FIFO or a device after
    the first look is still caught (the stat before opening only spares devices an open).
    Other failures raise the OSError of the call that failed.
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, mode)
    fd = os.open(path, _OPEN_FLAGS)
    with os.fdopen(fd, "rb", closefd=True) as f:  # closes fd on every path out
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, mode)
        return f.read(limit + 1)  # a buffered read loops until limit + 1 bytes or EOF


@dataclass(frozen=True, order=True)
class Span:
    """A half-open byte range [start, end) of a source, with 1-based line/column of both ends."""

    start: int
    end: int
    line: int
    col: int
    end_line: int
    end_col: int

    @classmethod
    def point(cls, line: int, col: int, pos: int = 0) -> Span:
        return cls(pos, pos + 1, line, col, line, col + 1)


@dataclass(frozen=True)
class Source:
    """The text of one .sched file and its name for messages."""

    path: str
    text: str
    _line_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        starts, text, i = [0], self.text, self.text.find("\n")
        while i >= 0:
            starts.append(i + 1)
            i = text.find("\n", i + 1)
        object.__setattr__(self, "_line_starts", tuple(starts))

    @classmethod
    def read(cls, path: str | Path) -> Source:
        """Read a file; raises CompileError for unreadable, binary or oversized input."""
        from schedc.errors import CompileError, Diagnostic

        try:
            data = read_limited(path, MAX_SOURCE_BYTES)
        except OSError as e:
            raise CompileError(
                [Diagnostic("io", f"cannot read file: {e.strerror or e}", path=str(path))]
            ) from None
        if len(data) > MAX_SOURCE_BYTES:
            try:  # the size for the message only: the limit held on the bytes read
                size = os.stat(path).st_size
            except OSError:
                size = 0
            limit = f"{MAX_SOURCE_BYTES:,}"
            said = f"{size:,} bytes" if size > MAX_SOURCE_BYTES else f"over {limit} bytes"
            raise CompileError(
                [
                    Diagnostic(
                        "file-too-large",
                        f"file is {said}; a schedule is at most {limit}",
                        hint="a .sched file describes one training step in a page of text",
                        path=str(path),
                    )
                ]
            )
        return cls.from_bytes(data, str(path))

    @classmethod
    def from_bytes(cls, data: bytes, path: str = "<input>") -> Source:
        from schedc.errors import CompileError, Diagnostic

        if len(data) > MAX_SOURCE_BYTES:
            raise CompileError(
                [
                    Diagnostic(
                        "file-too-large",
                        f"input is {len(data):,} bytes; a schedule is at most {MAX_SOURCE_BYTES:,}",
                        path=path,
                    )
                ]
            )
        # A byte-order mark is no part of the text: dropped, it moves no column. Offsets in
        # messages about bytes still count it, as a hex dump of the file would.
        skipped = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
        try:
            text = _newlines(data[skipped:].decode("utf-8"))
        except UnicodeDecodeError as e:
            good = _newlines(data[skipped : skipped + e.start].decode("utf-8"))
            src = cls(path, good)
            bad = skipped + e.start
            raise CompileError(
                [
                    Diagnostic(
                        "encoding",
                        f"byte 0x{data[bad]:02x} at offset {bad} is not UTF-8 text",
                        span=src.span_at(len(good)),
                        hint="a .sched file is UTF-8 text; is this a binary file?",
                        path=path,
                    )
                ],
                src,
            ) from None
        nul = text.find("\x00")
        if nul >= 0:
            src = cls(path, text)
            raise CompileError(
                [
                    Diagnostic(
                        "encoding",
                        "NUL byte in source",
                        span=src.span_at(nul),
                        hint="a .sched file is UTF-8 text; is this a binary file?",
                        path=path,
                    )
                ],
                src,
            ) from None
        return cls(path, text)

    @classmethod
    def from_string(cls, text: str, path: str = "<input>") -> Source:
        return cls.from_bytes(text.encode("utf-8"), path)

    # -- positions -----------------------------------------------------------------------

    @cached_property
    def lines(self) -> list[str]:
        return self.text.split("\n")

    def line_text(self, line: int) -> str:
        start, end = self.line_bounds(line)
        return self.text[start:end]

    def line_bounds(self, line: int) -> tuple[int, int]:
        """Offsets [start, end) of line `line` without its newline ((0, 0) past the end).

        An excerpt slices just the columns it shows from these, so a diagnostic on a line a
        megabyte long copies a hundred characters of it, not the line."""
        starts = self._line_starts
        if not 1 <= line <= len(starts):
            return 0, 0
        end = starts[line] - 1 if line < len(starts) else len(self.text)
        return starts[line - 1], end

    def line_col(self, pos: int) -> tuple[int, int]:
        """1-based (line, column) of byte offset `pos` (offsets are str indexes)."""
        pos = max(0, min(pos, len(self.text)))
        i = bisect.bisect_right(self._line_starts, pos) - 1
        return i + 1, pos - self._line_starts[i] + 1

    def span(self, start: int, end: int) -> Span:
        line, col = self.line_col(start)
        end_line, end_col = self.line_col(max(start, end))
        return Span(start, max(start, end), line, col, end_line, end_col)

    def span_at(self, pos: int) -> Span:
        return self.span(pos, min(pos + 1, len(self.text)) if self.text else pos)

    def snippet(self, span: Span) -> str:
        return self.text[span.start : span.end]
