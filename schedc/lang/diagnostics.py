"""Diagnostics: located, coded, sorted, rendered like a compiler's.

    schedules/ddp.sched:12:17: error: bucket 'b1' is reduced before ...  [early-reduce]
       12 |   bucket b1 = h.0 .. h.5
          |               ^~~~~~~~~~
      hint: move wte.weight to the last bucket

Every user error is a Diagnostic with a code from CODES. Stages collect all they find and
raise one CompileError; the CLI prints them sorted by position and exits 1. Anything else
that escapes is an internal error (exit 2, with traceback).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from schedc.ir.source import Source, Span


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    NOTE = "note"


# Every diagnostic code, with the rule it stands for. docs/diagnostics.md is generated from
# this table, and tests/lang/test_diagnostics.py holds at least one failing case for each code.
CODES: dict[str, str] = {
    # input
    "io": "the file cannot be read",
    "file-too-large": "the file is larger than a schedule can be (1 MiB)",
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
    # SPMD
    "spmd": "ranks that would issue different collectives, or in a different order",
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
        out = [f"{where}: {sev}: {self.message}  [{self.code}]"]
        if self.span and source is not None and source.path == path:
            out += _excerpt(source, self.span)
        for note in self.notes:
            npath = note.path or path
            nwhere = f"{npath}:{note.span.line}:{note.span.col}" if note.span else npath
            out.append(f"{nwhere}: note: {note.message}")
            if note.span and source is not None and source.path == npath:
                out += _excerpt(source, note.span)
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)


_SEV_COLOR = {Severity.ERROR: "31", Severity.WARNING: "33", Severity.NOTE: "36"}


def _paint(text: str, code: str, color: bool) -> str:
    return f"\x1b[1;{code}m{text}\x1b[0m" if color else text


def _excerpt(source: Source, span: Span) -> list[str]:
    """The numbered source line and a caret underline of the span (first line only)."""
    text = source.line_text(span.line).replace("\t", " ")
    gutter = str(span.line)
    end = span.end_col if span.end_line == span.line else len(text) + 1
    width = max(1, end - span.col)
    underline = "^" + "~" * (width - 1)
    pad = " " * len(gutter)
    return [
        f"  {gutter} | {text}",
        f"  {pad} | {' ' * (span.col - 1)}{underline}",
    ]


class UserError(Exception):
    """A mistake in how schedc was called (not in a schedule): printed, exit 1."""


class CompileError(Exception):
    """One or more user errors; `diagnostics` holds them all, sorted by position."""

    def __init__(self, diagnostics: Iterable[Diagnostic], source: Source | None = None):
        self.source = source
        path = source.path if source else None
        self.diagnostics = sorted(
            (d if d.path or not path else _with_path(d, path) for d in diagnostics),
            key=Diagnostic.sort_key,
        )
        super().__init__(self.render())

    @property
    def codes(self) -> list[str]:
        return [d.code for d in self.diagnostics]

    def render(self, color: bool = False) -> str:
        return "\n".join(d.render(self.source, color=color) for d in self.diagnostics)


def _with_path(d: Diagnostic, path: str) -> Diagnostic:
    from dataclasses import replace

    return replace(d, path=path)


@dataclass
class Diagnostics:
    """Collects the diagnostics of one stage; `raise_if_any` ends the stage if any is an error."""

    source: Source | None = None
    items: list[Diagnostic] = field(default_factory=list)

    def error(self, code: str, message: str, span: Span | None = None, hint: str | None = None,
              notes: tuple[Note, ...] = ()) -> None:
        self.items.append(Diagnostic(code, message, span, hint, Severity.ERROR, notes=notes))

    def warning(self, code: str, message: str, span: Span | None = None,
                hint: str | None = None) -> None:
        self.items.append(Diagnostic(code, message, span, hint, Severity.WARNING))

    def extend(self, items: Iterable[Diagnostic]) -> None:
        self.items.extend(items)

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.items if d.is_error]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.items if not d.is_error]

    def raise_if_any(self) -> None:
        if self.errors:
            raise CompileError(self.items, self.source)


def did_you_mean(word: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """'did you mean X?' for the closest candidate, or None."""
    cands = sorted(set(candidates))
    best = difflib.get_close_matches(word, cands, n=1, cutoff=cutoff)
    if not best:
        low = {c.lower(): c for c in cands}
        best = [low[word.lower()]] if word.lower() in low else []
    return f"did you mean '{best[0]}'?" if best else None
