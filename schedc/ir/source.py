"""Source text and the spans that point into it (lang/read.py makes Sources from files).

Every diagnostic carries a Span, so the first thing the compiler does is hold the text in
a form that can answer "what is on line 12" and "where is byte 340".
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property


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
