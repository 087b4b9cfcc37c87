"""Source text and the spans that point into it.

Every diagnostic carries a Span, so the first thing the compiler does is hold the text in
a form that can answer "what is on line 12" and "where is byte 340".
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

MAX_SOURCE_BYTES = 1 << 20  # a schedule is a page of text; anything larger is a mistake


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
        starts = [0]
        for i, ch in enumerate(self.text):
            if ch == "\n":
                starts.append(i + 1)
        object.__setattr__(self, "_line_starts", tuple(starts))

    @classmethod
    def read(cls, path: str | Path) -> Source:
        """Read a file; raises CompileError for unreadable, binary or oversized input."""
        from schedc.lang.diagnostics import CompileError, Diagnostic

        p = Path(path)
        try:
            size = p.stat().st_size
            if size > MAX_SOURCE_BYTES:
                raise CompileError(
                    [
                        Diagnostic(
                            "file-too-large",
                            f"file is {size:,} bytes; a schedule is at most {MAX_SOURCE_BYTES:,}",
                            hint="a .sched file describes one training step in a page of text",
                            path=str(path),
                        )
                    ]
                )
            data = p.read_bytes()
        except OSError as e:
            raise CompileError(
                [Diagnostic("io", f"cannot read file: {e.strerror or e}", path=str(path))]
            ) from None
        return cls.from_bytes(data, str(path))

    @classmethod
    def from_bytes(cls, data: bytes, path: str = "<input>") -> Source:
        from schedc.lang.diagnostics import CompileError, Diagnostic

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
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            src = cls(path, data[: e.start].decode("utf-8", errors="replace"))
            raise CompileError(
                [
                    Diagnostic(
                        "encoding",
                        f"byte 0x{data[e.start]:02x} at offset {e.start} is not UTF-8 text",
                        span=src.span_at(e.start),
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
        lines = self.lines
        return lines[line - 1] if 1 <= line <= len(lines) else ""

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
