"""What every resolve pass shares: the command-line flags, the diagnostics sink, the file's
statements by kind, and where each statement that may appear once was given.

Flags take precedence over the file (CLI flags > .sched file > defaults); they are judged by
the file's own rules and codes, placed at `schedc: --FLAG VALUE` since they have no line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from schedc.ir.source import Span
from schedc.lang.diagnostics import Diagnostic, Diagnostics, Note, did_you_mean
from schedc.lang.resolve.values import LIMITS, range_error
from schedc.lang.syntax import Schedule
from schedc.model.arch import SIZES

T = TypeVar("T")


@dataclass(frozen=True)
class Overrides:
    """Command-line flags, which take precedence over the file."""

    model: str | None = None
    steps: int | None = None
    seed: int | None = None
    precision: str | None = None  # a named policy: replaces the file's whole `precision`
    tf32: bool | None = None
    compile: bool | None = None
    val_every: int | None = None  # `eval { val_every }`: 0 turns validation off
    sample_every: int | None = None  # `eval { sample_every }`: 0 turns samples off
    hellaswag: str | None = None  # `eval { hellaswag }`: a local HellaSwag .jsonl
    hellaswag_every: int | None = None  # `eval { hellaswag_every }`: 0 turns it off

    def diagnostics(self) -> list[Diagnostic]:
        """The flags judged by the file's own rules (LIMITS, SIZES) with the file's codes.

        A flag has no line to point at: its diagnostics are placed at `schedc: --FLAG VALUE`,
        as a file's are at `path:line:col`. The resolver reports these too, so every caller
        of the compiler gets them; the CLI asks first, to say them once, not once per file.
        """
        out = []
        for key in ("steps", "seed"):
            v = getattr(self, key)
            if v is not None and (bad := range_error(key, v, *LIMITS[key])) is not None:
                out.append(Diagnostic("value-range", bad, path=flag_place(key, v)))
        if self.model is not None and self.model not in SIZES:
            out.append(
                Diagnostic(
                    "unknown-model",
                    f"unknown model '{self.model}'",
                    path=flag_place("model", self.model),
                    hint=did_you_mean(self.model, SIZES) or f"known sizes: {', '.join(SIZES)}",
                )
            )
        return out


def flag_place(flag: str, value) -> str:
    """Where a diagnostic about a command-line value is reported: `schedc: --steps -5`."""
    text = str(value)
    return f"schedc: --{flag} {text if len(text) <= 40 else text[:20] + '...'}"


def prefer(flag: T | None, file: T | None, default: T) -> T:
    """The one precedence rule: the flag's value, else the file's, else the default."""
    if flag is not None:
        return flag
    return file if file is not None else default


class Context:
    """One resolve run: passes report through `err` and `once`, and read the statements
    they judge with `all` and `single`."""

    def __init__(self, ast: Schedule, overrides: Overrides):
        self.ov = overrides
        self.src = ast.source
        self.diag = Diagnostics(self.src)
        self.diag.extend(overrides.diagnostics())  # the flags, by the file's rules
        # each statement that may appear once, by key (`world`, `model.n_layer`, `ddp.overlap`)
        # -> where it was first given: Spec.where
        self.seen: dict[str, Span] = {}
        # every bucket and unit named what exists: else proving coverage would only repeat
        # the same mistake (a misspelled layer reported as uncovered too)
        self.refs_ok = True
        self._by_type: dict[type, list[Any]] = {}
        for s in ast.stmts:
            self._by_type.setdefault(type(s), []).append(s)

    def err(self, code: str, msg: str, span: Span | None, hint: str | None = None, notes=()):
        self.diag.error(code, msg, span, hint, notes)

    def once(self, key: str, span: Span, what: str) -> bool:
        """Record a statement that may appear once; report the repeat."""
        if key in self.seen:
            first = self.seen[key]
            self.err(
                "duplicate",
                f"{what} is given twice",
                span,
                hint="keep one of them",
                notes=(Note(f"first given at line {first.line}", first),),
            )
            return False
        self.seen[key] = span
        return True

    def all(self, kind: type[T]) -> list[T]:
        """The file's top-level statements of one kind, in the order written."""
        return self._by_type.get(kind, [])

    def single(self, kind: type[T], key: str, what: str) -> T | None:
        """The first statement of a kind that may appear once; each repeat is reported."""
        items = self._by_type.get(kind, [])
        for item in items:
            self.once(key, item.span, what)
        return items[0] if items else None
