"""Diagnostics: located, coded, sorted, rendered like a compiler's.

    schedules/ddp.sched:12:17: error: bucket 'b1' is reduced before ...  [early-reduce]
       12 |   bucket b1 = h.0 .. h.5
          |               ^~~~~~~~~~
      hint: move wte.weight to the last bucket

Every error in a schedule is a Diagnostic with a code from CODES. Stages collect all they
find and raise one CompileError, a UserError (schedc/errors.py): the CLI prints them sorted
by position and exits 1. Anything else that escapes is an internal error (exit 2, with
traceback).

A file under the size limit can still hold the same mistake a hundred thousand times, on
one line a megabyte long, so every part of a report is bounded: a stage keeps the first
MAX_KEPT errors (and warnings) it finds and only counts the rest; a report prints the
first MAX_SHOWN by position, then "... and N more errors"; an excerpt shows at most
EXCERPT_COLUMNS columns of its line around the caret; a message is cut at MAX_MESSAGE
characters (a note of several lines, a pipeline's programs side by side, at MAX_MESSAGE
a line and MAX_NOTE_LINES lines). A diagnostic holds a Span (offsets), never a copy of its
line, and nothing is rendered until it is printed.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from schedc.errors import UserError
from schedc.ir.source import Source, Span

MAX_KEPT = 1000  # diagnostics of each severity a stage keeps; the rest are counted
MAX_SHOWN = 50  # diagnostics a report prints, the first by position
EXCERPT_COLUMNS = 160  # columns of a source line an excerpt shows; longer ones are cut
MAX_MESSAGE = 400  # characters of a message, hint or note (a name can be a megabyte long)
MAX_NOTE_LINES = 40  # lines of a note (the ranks' programs side by side are a table)


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    NOTE = "note"


# Every diagnostic code, with the rule it stands for. docs/diagnostics.md is generated from
# this table, and tests/lang/test_diagnostics.py holds at least one failing case for each code.
CODES: dict[str, str] = {
    # input
    "io": "the file cannot be read, or is no regular file (a directory, FIFO, device)",
    "file-too-large": "the file is larger than a schedule can be (1 MiB, 50,000 tokens)",
    "encoding": "the file is not UTF-8 text",
    "syntax": "the text does not follow the grammar",
    "unclosed": "a '{' block is never closed",
    # names and values
    "unknown-name": "a layer, parameter, bucket, unit or stream that does not exist",
    "unknown-setting": "a key that the block does not have",
    "unknown-model": "a model size that schedc does not know",
    "duplicate": "a name or a setting given twice",
    "missing-setting": "a setting the schedule cannot do without",
    "value-range": "a number outside what the setting allows",
    "layer-range": "a layer past the end of the model (h.N with N >= n_layer)",
    "model-config": "model dimensions that do not fit together",
    "conflict": "two statements that cannot both hold",
    "dtype": "a dtype schedc does not train in (fp16 needs loss scaling; bf16 does not)",
    # batch arithmetic
    "batch-arithmetic": "global sequences != micro x accumulation x world",
    "context-length": "the sequence length exceeds the model's context",
    "disagree": "two schedules that differ in model, global batch, scaling, data, seed or "
    "optimizer",
    # coverage and sharding
    "uncovered": "a parameter in no bucket (DDP) or no unit (FSDP)",
    "double-cover": "a parameter in two buckets or two units",
    "tied-param": "the tied wte/lm_head weight sharded where its two users cannot both see it",
    "unit-contiguous": "a unit that is not kept gathered but is used by non-adjacent layers",
    "mesh-size": "a mesh whose replicate x shard is not the world (in a pipeline file, not a "
    "stage's dp = world / degree replicas), or a pipeline degree that does not divide the world",
    "mesh-ddp": "a mesh that shards a DDP schedule (DDP replicates over the whole world), or any "
    "mesh in a pipeline file without an fsdp block",
    "memory-budget": "the predicted peak memory per rank exceeds the declared budget",
    # streams and events
    "cycle": "the dependency graph has a cycle",
    "deadlock": "an op waits for something later on its own stream",
    "compute-stream": "compute work (fwd, bwd, free, optimizer) placed off the compute stream",
    "missing-event": "a cross-stream dependency with no event",
    "out-of-order": "an op placed before an op on its own stream whose result it needs",
    "missing-op": "an op the step needs is absent from a written program",
    "unexpected-op": "a written program holds an op the schedule does not have",
    "duplicate-op": "an op written twice",
    # gradients
    "early-reduce": "a reduction launched before the last backward that writes its gradients",
    "nosync-comm": "a collective in a no_sync micro-step",
    "optimizer-wait": "the optimizer step does not wait for every reduction",
    # sharding at run time
    "use-after-free": "a unit's parameters used while it is not gathered",
    # recomputation
    "recompute-gather": "a recompute that can run before its layer's unit is gathered",
    "recompute-late": "a backward that can start before the recompute of its layer",
    "recompute-freed": "a recompute of a layer not declared `recompute`: its forward freed "
    "its input",
    # SPMD
    "spmd": "ranks that would issue different collectives, or in a different order",
    "proof": "the ranks' plans, executed abstractly, do not compute one process's update",
    # pipeline stages
    "stage-order": "a pipeline stage that is not one contiguous run of layers, or stages out "
    "of model order",
    "stage-count": "a stage count the schedule cannot place on the pipeline's ranks (one stage "
    "a rank, v >= 2 with interleaved, 2 in a V with zb-v)",
    # pipeline programs
    "pp-placement": "a pipeline action on a rank that does not hold its stage, or for a "
    "stage or micro-batch the pipeline does not have",
    "pp-once": "a stage's F, and its B or I and W, not run exactly once per micro-batch",
    "pp-order": "a pipeline action before one whose result it reads on its rank",
    "pp-unmatched": "a send with no receive of the same tag and communicator, or a receive "
    "with no send",
    "pp-fifo": "a FIFO inversion: the k-th send and the k-th receive of a communicator "
    "carry different tags",
    "pp-deadlock": "happens-before under blocking point-to-point has a cycle",
    "pp-microbatches": "fewer micro-batches than a named pipeline schedule needs",
    # warnings
    "bucket-order": "buckets listed in an order other than the one their gradients complete",
    "tied-late": "a bucket holding the tied weight, which completes only at the end of backward",
}


@dataclass(frozen=True)
class Note:
    message: str
    span: Span | None = None
    path: str | None = None


@dataclass(frozen=True)
class Diagnostic:
    code: str
    message: str
    span: Span | None = None
    hint: str | None = None
    severity: Severity = Severity.ERROR
    path: str | None = None  # filled in by CompileError from its source when absent
    notes: tuple[Note, ...] = ()

    def __post_init__(self) -> None:
        assert self.code in CODES, f"unregistered diagnostic code {self.code!r}"

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def sort_key(self) -> tuple:
        s = self.span
        return (self.path or "", s.start if s else -1, self.code, self.message)

    def render(self, source: Source | None = None, *, color: bool = False) -> str:
        path = self.path or (source.path if source else "<input>")
        where = f"{path}:{self.span.line}:{self.span.col}" if self.span else path
        sev = _paint(self.severity.value, _SEV_COLOR[self.severity], color)
        out = [f"{where}: {sev}: {_clip(self.message)}  [{self.code}]"]
        if self.span and source is not None and source.path == path:
            out += _excerpt(source, self.span)
        for note in self.notes:
            npath = note.path or path
            nwhere = f"{npath}:{note.span.line}:{note.span.col}" if note.span else npath
            out.append(f"{nwhere}: note: {_clip_lines(note.message)}")
            if note.span and source is not None and source.path == npath:
                out += _excerpt(source, note.span)
        if self.hint:
            out.append(f"  hint: {_clip(self.hint)}")
        return "\n".join(out)


_SEV_COLOR = {Severity.ERROR: "31", Severity.WARNING: "33", Severity.NOTE: "36"}


def _paint(text: str, code: str, color: bool) -> str:
    return f"\x1b[1;{code}m{text}\x1b[0m" if color else text


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else f"{text[: MAX_MESSAGE - 3]}..."


def _clip_lines(text: str) -> str:
    """A note's lines, each cut at MAX_MESSAGE, the first MAX_NOTE_LINES of them."""
    lines = text.split("\n", MAX_NOTE_LINES)
    more = ["..."] if len(lines) > MAX_NOTE_LINES else []
    return "\n".join([_clip(line) for line in lines[:MAX_NOTE_LINES]] + more)


# What an excerpt prints for characters that would not show as one column of text: a tab is
# a space; control characters (a terminal would obey an escape sequence), line and paragraph
# separators and bidirectional overrides (which reorder what the reader sees) are U+FFFD.
_SHOWN = {9: " "} | {
    c: "\ufffd"
    for c in [
        *range(32),
        *range(0x7F, 0xA0),
        0x2028,
        0x2029,
        *range(0x202A, 0x202F),
        *range(0x2066, 0x206A),
    ]
    if c != 9
}


def _excerpt(source: Source, span: Span) -> list[str]:
    """The numbered source line and a caret underline of the span (first line only).

    A line longer than EXCERPT_COLUMNS shows a window of that many columns, the span's start
    a third of the way in, with "..." where the line goes on; only the window is copied.
    """
    lo, hi = source.line_bounds(span.line)
    n, c0 = hi - lo, span.col - 1  # line length; 0-based column where the span starts
    end = span.end_col - 1 if span.end_line == span.line else n
    a, b = 0, n  # the columns shown
    if n > EXCERPT_COLUMNS:
        a = max(0, min(c0 - EXCERPT_COLUMNS // 3, n - EXCERPT_COLUMNS))
        b = a + EXCERPT_COLUMNS
    left, right = ("..." if a > 0 else ""), ("..." if b < n else "")
    text = source.text[lo + a : lo + b].translate(_SHOWN)
    width = max(1, min(end, b if right else end) - c0)
    underline = "^" + "~" * (width - 1)
    gutter = str(span.line)
    pad = " " * len(gutter)
    return [
        f"  {gutter} | {left}{text}{right}",
        f"  {pad} | {' ' * (len(left) + c0 - a)}{underline}",
    ]


def render_all(
    diagnostics: list[Diagnostic],
    source: Source | None = None,
    *,
    color: bool = False,
    unkept_errors: int = 0,
    unkept_warnings: int = 0,
    limit: int = MAX_SHOWN,
) -> str:
    """The first `limit` diagnostics, rendered, then a line counting the rest (with those a
    stage counted without keeping)."""
    out = [d.render(source, color=color) for d in diagnostics[:limit]]
    rest = diagnostics[limit:]
    more = len(rest) + unkept_errors + unkept_warnings
    if more:
        errors = not unkept_warnings and all(d.is_error for d in rest)
        what = ("error" if errors else "diagnostic") + ("s" if more != 1 else "")
        out.append(f"... and {more:,} more {what} (the first {limit} by position are shown)")
    return "\n".join(out)


class CompileError(UserError):
    """One or more errors in a schedule (or in a flag that overrides it); `diagnostics`
    holds them all, sorted by position.

    `unkept_errors` and `unkept_warnings` count those a stage found past MAX_KEPT and did
    not keep. The message is rendered when asked for (str, render), not when raised.
    """

    def __init__(
        self,
        diagnostics: Iterable[Diagnostic],
        source: Source | None = None,
        *,
        unkept_errors: int = 0,
        unkept_warnings: int = 0,
    ):
        self.source = source
        path = source.path if source else None
        self.diagnostics = sorted(
            (d if d.path or not path else _with_path(d, path) for d in diagnostics),
            key=Diagnostic.sort_key,
        )
        self.unkept_errors, self.unkept_warnings = unkept_errors, unkept_warnings
        super().__init__()

    def __str__(self) -> str:
        return self.render()

    @property
    def codes(self) -> list[str]:
        return [d.code for d in self.diagnostics]

    @property
    def error_count(self) -> int:
        """Every error found, kept or only counted."""
        return sum(1 for d in self.diagnostics if d.is_error) + self.unkept_errors

    def render(self, color: bool = False) -> str:
        return render_all(
            self.diagnostics,
            self.source,
            color=color,
            unkept_errors=self.unkept_errors,
            unkept_warnings=self.unkept_warnings,
        )


def _with_path(d: Diagnostic, path: str) -> Diagnostic:
    from dataclasses import replace

    return replace(d, path=path)


@dataclass
class Diagnostics:
    """Collects the diagnostics of one stage; `raise_if_any` ends the stage if any is an error.

    It keeps the first MAX_KEPT errors and the first MAX_KEPT warnings and counts the rest,
    so a mistake repeated a hundred thousand times costs a counter, not a list.
    """

    source: Source | None = None
    items: list[Diagnostic] = field(default_factory=list)
    unkept_errors: int = 0
    unkept_warnings: int = 0
    _kept: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0}, repr=False)

    def error(
        self,
        code: str,
        message: str,
        span: Span | None = None,
        hint: str | None = None,
        notes: tuple[Note, ...] = (),
    ) -> None:
        self._add(Diagnostic(code, message, span, hint, Severity.ERROR, notes=notes))

    def warning(
        self, code: str, message: str, span: Span | None = None, hint: str | None = None
    ) -> None:
        self._add(Diagnostic(code, message, span, hint, Severity.WARNING))

    def extend(self, items: Iterable[Diagnostic]) -> None:
        for d in items:
            self._add(d)

    def _add(self, d: Diagnostic) -> None:
        if self._kept[d.is_error] < MAX_KEPT:
            self._kept[d.is_error] += 1
            self.items.append(d)
        elif d.is_error:
            self.unkept_errors += 1
        else:
            self.unkept_warnings += 1

    @property
    def full(self) -> bool:
        """Whether a further error would only be counted (so its hint need not be worked out)."""
        return self._kept[True] >= MAX_KEPT

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.items if d.is_error]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.items if not d.is_error]

    def raise_if_any(self) -> None:
        if self.errors:
            raise CompileError(
                self.items,
                self.source,
                unkept_errors=self.unkept_errors,
                unkept_warnings=self.unkept_warnings,
            )


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`1 bucket`, `2 buckets`, `1,024 tokens`: a number and its noun, agreeing."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def did_you_mean(word: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """'did you mean X?' for the closest candidate, or None."""
    return _closest(word, tuple(sorted(set(candidates))), cutoff)


@functools.lru_cache(maxsize=256)  # a mistake repeated 50,000 times is looked up once
def _closest(word: str, cands: tuple[str, ...], cutoff: float) -> str | None:
    best = difflib.get_close_matches(word, cands, n=1, cutoff=cutoff)
    if not best:
        low = {c.lower(): c for c in cands}
        best = [low[word.lower()]] if word.lower() in low else []
    return f"did you mean '{best[0]}'?" if best else None
